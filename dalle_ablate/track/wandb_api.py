"""Reading from W&B and writing W&B Reports: everything outside the training run that talks to
W&B (the report builds on these; nothing outside track/ imports wandb)."""

from __future__ import annotations

from typing import Iterator, NamedTuple


class GroupRun(NamedTuple):
    name: str
    id: str
    config: dict
    summary: dict
    history: list[dict]  # one dict per logged step, `_step` as `step`, W&B's other `_` keys dropped


def group_runs(entity: str, project: str, group: str, api=None) -> Iterator[GroupRun]:
    """The runs of a W&B group with their full history (needs a login and network; `api`: a
    stand-in for wandb.Api in tests)."""
    if api is None:
        import wandb

        api = wandb.Api(timeout=60)
    for r in api.runs(f"{entity}/{project}", filters={"group": group}):
        rows = [
            {("step" if k == "_step" else k): v for k, v in row.items() if not k.startswith("_") or k == "_step"}
            for row in r.scan_history()
        ]
        yield GroupRun(r.name, r.id, dict(r.config), dict(r.summary), rows)


def wandb_report(
    title: str,
    group: str | None,
    groupby: list[str],
    metrics: list[str],
    media: list[str],
    entity: str = "",
    project: str = "",
):
    """The report's structure as a W&B report (wandb-workspaces): a run set filtered by the W&B
    group and grouped by the config fields that vary apart from the seed (so each variant's seeds
    make one line with its spread), then panels over tokens: the losses and the gradient norm,
    the logged `metrics` (headline eval metrics by scale, the optimizer's own), the Pareto plots
    and grids (`media` keys), and a run comparer of the configs."""
    import wandb_workspaces.reports.v2 as wr

    filters = f'Group = "{group}"' if group else ""
    # Offline: no entity/project on the run set (resolving them is a network call); the spec
    # records the group, and `--wandb-entity/--wandb-project` save it to W&B when online.
    runset = wr.Runset(entity=entity, project=project, name=group or "runs", filters=filters, groupby=list(groupby))

    def grid(*panels):
        return wr.PanelGrid(runsets=[runset], panels=list(panels))

    def line(y: str, **kw):
        return wr.LinePlot(x="tokens", y=[y], title=y, title_x="tokens", title_y=y, **kw)

    evals = [m for m in metrics if m.startswith("eval/")]
    optim = [m for m in metrics if m.startswith("optim/")]
    blocks = [
        wr.H1(title),
        wr.P(
            "Built by dalle-ablate report from the same run stores as the HTML report; each line is "
            f"a variant ({', '.join(groupby) or 'all runs'}), its band the spread of its seeds."
        ),
        wr.H2("Loss and gradient norm"),
        grid(line("train/loss"), line("eval/valid/loss"), line("train/grad_norm", log_y=True)),
    ]
    if evals:
        blocks += [wr.H2("Evaluation by guidance scale"), grid(*(line(m) for m in evals))]
    if media:
        browsers = [wr.MediaBrowser(media_keys=[k], title=k, num_columns=1) for k in media]
        blocks += [wr.H2("Pareto plots and grids"), grid(*browsers)]
    if optim:
        blocks += [wr.H2("Optimizer"), grid(*(line(m) for m in optim))]
    blocks += [wr.H2("Final metrics"), grid(wr.RunComparer(diff_only="split"))]
    return wr.Report(project=project or "dalle-ablate", entity=entity or "offline", title=title, blocks=blocks)


def report_spec(report) -> dict:
    """A W&B report as JSON (what `wandb_report.json` holds), without saving it anywhere."""
    import json

    return json.loads(report._to_model().model_dump_json(by_alias=True))
