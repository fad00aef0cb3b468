"""The report's sections written out: one self-contained HTML page (figures inline as PNG data,
no scripts, no network, every text escaped; long sections collapsible) and Markdown with its
figures beside it."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dalle_ablate.report.tables import fmt


@dataclass
class Section:
    key: str
    title: str
    text: list[str] = field(default_factory=list)  # paragraphs (plain text, escaped on output)
    tables: list[tuple[list[str], list[list]]] = field(default_factory=list)
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (caption, png)
    folded: bool = False  # long and secondary: closed until clicked
    # its subsections, after its own text, tables and figures, each under a heading one level down:
    # a paragraph stays beside the table it is about
    parts: list["Section"] = field(default_factory=list)

    def all_tables(self) -> list[tuple[list[str], list[list]]]:
        """Its tables, then its subsections', in the order written."""
        return self.tables + [t for p in self.parts for t in p.all_tables()]


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.4em 0}section{margin-bottom:1.6em}
figcaption{font-size:12px;color:#555}.sig{color:#b00;font-weight:bold}
details>summary{cursor:pointer}details>summary h2{display:inline}.scroll{overflow-x:auto;max-width:100%}"""


def _cell(v, number: Callable = fmt) -> str:
    text = html.escape(number(v))
    return f'<td class="sig">{text}</td>' if text == "*" else f"<td>{text}</td>"


def to_html(title: str, sections: list[Section], number: Callable = fmt) -> str:
    """The page; `number` prints the table cells."""
    out = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{CSS}</style>"
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<nav>",
    ]
    out.append(" · ".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections))
    out.append("</nav>")
    for s in sections:
        # <details> folds a section without a script; the summary line stays as its heading.
        out.append(
            f'<section id="{s.key}"><details{"" if s.folded else " open"}><summary><h2>{html.escape(s.title)}</h2>'
            "</summary>"
        )
        out += _html_body(s, number)
        out.append("</details></section>")
    out.append("</body></html>")
    return "\n".join(out)


def _html_body(s: Section, number: Callable, level: int = 2) -> list[str]:
    """A section's text, tables, figures, then its subsections under <h3> (and deeper)."""
    out = [f"<p>{html.escape(t)}</p>" for t in s.text]
    for cols, rows in s.tables:
        # a table wider than the page (many columns) scrolls in its own box, not the page
        out.append(
            '<div class="scroll"><table><tr>' + "".join(f"<th>{html.escape(str(c))}</th>" for c in cols) + "</tr>"
        )
        out += ["<tr>" + "".join(_cell(v, number) for v in row) + "</tr>" for row in rows]
        out.append("</table></div>")
    for caption, img in s.images:
        data = base64.b64encode(img).decode()
        out.append(
            f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    for p in s.parts:
        out.append(f'<h{level + 1} id="{p.key}">{html.escape(p.title)}</h{level + 1}>')
        out += _html_body(p, number, level + 1)
    return out


def _md_cell(v, number: Callable = fmt) -> str:
    return number(v).replace("|", "\\|").replace("\n", " ")


def to_markdown(title: str, sections: list[Section], folder: Path, number: Callable = fmt) -> str:
    """Markdown with each section's figures written to `folder`/figures/, each image followed by
    its caption as a line of its own (italic); `number` prints the table cells."""
    out = [f"# {title}", ""]
    for s in sections:
        out += _md_section(s, folder, number)
    return "\n".join(out)


def _md_section(s: Section, folder: Path, number: Callable, level: int = 2) -> list[str]:
    out = ["#" * level + f" {s.title}", ""]
    out += [t + "\n" for t in s.text]
    for cols, rows in s.tables:
        out.append("| " + " | ".join(_md_cell(c, number) for c in cols) + " |")
        out.append("|" + "---|" * len(cols))
        out += ["| " + " | ".join(_md_cell(v, number) for v in row) + " |" for row in rows]
        out.append("")
    for i, (caption, img) in enumerate(s.images):
        name = f"figures/{s.key}_{i}.png"
        (folder / name).write_bytes(img)
        out += [f"![{caption}]({name})", "", "*" + caption.replace("*", "\\*") + "*", ""]
    for p in s.parts:
        out += _md_section(p, folder, number, level + 1)
    return out
