"""Pre-encoded data in dalle-mini's format: parquet files with a caption column and an encoding
column (a list of image-code ints per row), streamed with pyarrow through a shuffle buffer.

Every row is checked as it streams, and a bad one fails in one line naming the file, the row and
the column: captions must be UTF-8 strings (null = blank), codes lists of integers of the model's
length, none null, all inside the codebook; an unreadable row group names the rows it held.
Before training, a pre-flight scan of the first rows reports the row count, the blank-caption
share and the range of codes used, and refuses a set without any caption (unless
`data.allow_blank_captions`). Without `data.valid_path`, a fixed hash of
(file name, row) holds out `data.valid_fraction` of the rows, so train and valid never overlap.
Hosts split rows by index (row % process_count), so their shares are disjoint and complete.
"""

from __future__ import annotations

import glob
import logging
import posixpath
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import MISSING

from dalle_ablate.data.base import DATASETS, Batch, DataConfig, Dataset, eval_index_batches, host_share
from dalle_ablate.data.image_tokenizer import PatchCodebook
from dalle_ablate.data.text_tokenizer import TextTokenizer
from dalle_ablate.fileio import check_url, glob_urls, is_url, open_url
from dalle_ablate.registry import ConfigError, first_line

log = logging.getLogger(__name__)

_READ_ROWS = 4096  # rows per record batch read from a file
_SCAN_ROWS = 100_000  # rows the pre-flight scan reads (and a BPE tokenizer is trained on when none is given)


@dataclass
class ParquetDataConfig(DataConfig):
    """dalle-mini's format: parquet files with a caption column and a list-of-int code column."""

    RANGES = {
        "valid_fraction": "[0, 1)",
        "image_vocab": "[1, inf)",
        "image_len": "[1, inf) or null",
        "shuffle_buffer": "[1, inf)",
        "valid_max_rows": "[1, inf)",
    }

    name: str = "parquet"
    path: str = MISSING  # a file, a folder or a glob of training files, local or in a bucket (gs://...)
    valid_path: Optional[str] = None  # the same for validation; null = hold out valid_fraction of rows by hash
    valid_fraction: float = 0.01  # rows held out for validation when valid_path is null
    caption_column: str = "caption"  # the column of caption strings
    encoding_column: str = "encoding"  # the column of image codes (a list of ints per row)
    image_vocab: int = 16384  # codes of the VQGAN that encoded the images (dalle-mini's: 16384)
    image_len: Optional[int] = None  # null = model.image_len, else the first row's length
    shuffle_buffer: int = 10000  # rows the training stream shuffles among
    codebook_path: Optional[str] = None  # a patch codebook (.npz) to decode samples; null = no grid
    vqgan_path: Optional[str] = None  # or VQGAN weights (.npz, dalle-ablate convert-vqgan) to decode them
    valid_max_rows: int = 2048  # rows of the validation split read, at most
    allow_blank_captions: bool = False  # train on a set whose captions are all blank (unconditional)

    def image_sizes(self) -> dict[str, Optional[int]]:
        return {"image_len": self.image_len, "image_vocab": self.image_vocab}


def list_files(spec: str, field: str) -> list[Path | str]:
    """The parquet files `spec` names: a file, a folder (its *.parquet) or a glob, local or in a
    bucket (gs:// URLs, each file read as it streams, through fsspec)."""
    if is_url(spec):
        url = check_url(spec, field)
        files = glob_urls(url if any(c in url for c in "*?[") or url.endswith(".parquet") else f"{url}/*.parquet")
        if not files:
            raise ConfigError(f"{field}={spec} matches no parquet file")
        return files
    p = Path(spec).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*.parquet"))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(str(p)))
    if not files:
        raise ConfigError(f"{field}={spec} matches no parquet file")
    return files


def _held_out(file: Path | str, rows: np.ndarray, fraction: float) -> np.ndarray:
    """Deterministic per-row split: splitmix64 of (crc32(file name), row) below the fraction (a
    file's name, the same in a bucket as on a disk)."""
    z = (np.uint64(zlib.crc32(posixpath.basename(str(file)).encode())) << np.uint64(32)) + rows.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


class ParquetRows:
    """Reads the caption and code columns of dalle-mini's parquet files, checking them as it goes:
    each file's schema when it is opened, each row group as it is read, each batch's captions
    (UTF-8) and codes (present, `image_len` of them, inside the codebook); a problem is one line
    naming the file, the row and the field to set."""

    def __init__(self, cfg, image_len: Optional[int] = None):
        self.cfg = cfg
        self.image_vocab = cfg.image_vocab
        self.image_len = image_len

    def open(self, file: Path) -> pq.ParquetFile:
        try:
            pf = pq.ParquetFile(open_url(file) if is_url(file) else file)
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(f"{file}: not a readable parquet file: {first_line(e)}") from e
        schema = pf.schema_arrow
        for col, field in ((self.cfg.caption_column, "caption_column"), (self.cfg.encoding_column, "encoding_column")):
            if col not in schema.names:
                raise ConfigError(f"{file}: no column {col!r} (columns: {', '.join(schema.names)}); set data.{field}")
        cap = schema.field(self.cfg.caption_column).type
        if not (pa.types.is_string(cap) or pa.types.is_large_string(cap)):
            # Binary captions would turn into "b'...'" reprs; other types are not text at all.
            raise ConfigError(
                f"{file}: column {self.cfg.caption_column!r} has type {cap}; captions must be UTF-8 strings "
                f"(data.caption_column)"
            )
        enc = schema.field(self.cfg.encoding_column).type
        if not pa.types.is_list(enc) and not pa.types.is_large_list(enc) and not pa.types.is_fixed_size_list(enc):
            raise ConfigError(
                f"{file}: column {self.cfg.encoding_column!r} has type {enc}; expected a list of integer "
                f"codes per row (data.encoding_column)"
            )
        if not pa.types.is_integer(enc.value_type):
            # Floats would be truncated silently, strings fail deep inside numpy.
            raise ConfigError(
                f"{file}: column {self.cfg.encoding_column!r} holds {enc.value_type} codes; codes must be "
                f"integers in [0, {self.image_vocab})"
            )
        return pf

    def record_batches(self, file: Path, pf: pq.ParquetFile) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(first row, record batch) of the caption and code columns, row group by row group: a
        corrupt group fails naming the file and its rows (the footer alone can look fine)."""
        row = 0
        for g in range(pf.num_row_groups):
            start, n = row, pf.metadata.row_group(g).num_rows
            batches = pf.iter_batches(
                batch_size=_READ_ROWS, row_groups=[g], columns=[self.cfg.caption_column, self.cfg.encoding_column]
            )
            while True:
                try:
                    rb = next(batches)
                except StopIteration:
                    break
                except (pa.ArrowException, OSError) as e:
                    raise ConfigError(
                        f"{file}: rows {start}..{start + n - 1} (row group {g}) cannot be read (corrupt file?): "
                        f"{first_line(e)}"
                    ) from e
                yield row, rb
                row += rb.num_rows

    def first_length(self, file: Path) -> int:
        """The number of codes in the file's first row: the image length the data has."""
        for _, rb in self.record_batches(file, self.open(file)):
            first = rb.column(1)[0]
            if not first.is_valid:
                raise ConfigError(f"{file}: row 0: column {self.cfg.encoding_column!r} is null")
            return len(first)
        raise ConfigError(f"{file}: file has no rows")

    def captions(self, file: Path, first_row: int, col: pa.Array) -> list[str]:
        """The captions of a record batch, null as blank; invalid UTF-8 named by row."""
        try:
            col.validate(full=True)  # parquet readers do not check that strings are UTF-8
        except pa.ArrowInvalid:
            for r, raw in enumerate(
                col.view(pa.binary() if pa.types.is_string(col.type) else pa.large_binary()).to_pylist()
            ):
                try:
                    raw is None or raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(
                        f"{file}: row {first_row + r}: column {self.cfg.caption_column!r} is not valid UTF-8 "
                        f"(byte {e.start}: {raw[e.start : e.start + 1]!r})"
                    ) from None
            raise
        return ["" if c is None else c for c in col.to_pylist()]

    def codes(self, file: Path, first_row: int, col: pa.Array) -> np.ndarray:
        enc = self.cfg.encoding_column
        lengths = pc.list_value_length(col)
        if lengths.null_count:
            r = int(np.flatnonzero(pc.is_null(lengths).to_numpy(zero_copy_only=False))[0])
            raise ConfigError(f"{file}: row {first_row + r}: column {enc!r} is null (no codes)")
        lengths = lengths.to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != self.image_len)
        if len(bad):
            r = int(bad[0])
            raise ConfigError(
                f"{file}: row {first_row + r}: column {enc!r} has {lengths[r]} codes, expected {self.image_len}"
            )
        values = col.flatten()
        if values.null_count:
            i = int(np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))[0])
            raise ConfigError(
                f"{file}: row {first_row + i // self.image_len}: column {enc!r} has a null code at "
                f"position {i % self.image_len}"
            )
        codes = values.to_numpy(zero_copy_only=False).reshape(len(col), self.image_len)
        out = (codes < 0) | (codes >= self.image_vocab)
        if out.any():
            r, c = map(int, np.argwhere(out)[0])
            raise ConfigError(
                f"{file}: row {first_row + r}: code {int(codes[r, c])} at position {c} is outside the "
                f"codebook [0, {self.image_vocab}) (data.image_vocab)"
            )
        return codes.astype(np.int32)


class ParquetDataset(Dataset):
    name = "parquet"

    def __init__(self, cfg, text_len: int, image_len: Optional[int]):
        self.cfg = cfg
        self.files = list_files(cfg.path, "data.path")
        self.valid_files = list_files(cfg.valid_path, "data.valid_path") if cfg.valid_path else None
        self.image_vocab = cfg.image_vocab
        self.blank_caption_prob = cfg.blank_caption_prob
        self.read = ParquetRows(cfg)
        self.image_len = self.read.image_len = image_len or cfg.image_len or self.read.first_length(self.files[0])
        self.codebook = None
        if cfg.codebook_path:
            self.codebook = PatchCodebook.load(Path(cfg.codebook_path).expanduser())
            if self.codebook.size != self.image_vocab:
                raise ConfigError(
                    f"data.codebook_path has {self.codebook.size} codes but data.image_vocab={self.image_vocab}"
                )
        self.vqgan = None
        if cfg.vqgan_path:
            if cfg.codebook_path:
                raise ConfigError(
                    "data.codebook_path and data.vqgan_path are both set; the codes come from one image tokenizer"
                )
            from dalle_ablate.vqgan import load_vqgan

            self.vqgan = load_vqgan(cfg.vqgan_path, "data.vqgan_path")
            if self.vqgan.cfg.n_embed != self.image_vocab:
                raise ConfigError(
                    f"data.vqgan_path has {self.vqgan.cfg.n_embed} codes but data.image_vocab={self.image_vocab}"
                )
        if cfg.tokenizer_path:
            self.text = TextTokenizer.from_file(cfg.tokenizer_path, text_len)
        captions, scan = self._preflight()
        if not cfg.tokenizer_path:
            self.text = TextTokenizer.trained_or_cached(
                captions, cfg.text_vocab_size, text_len, Path(cfg.cache_dir).expanduser()
            )
        self.valid = self._load_valid()
        self.info = {
            "files": len(self.files),
            "image_len": self.image_len,
            "image_vocab": self.image_vocab,
            "text_vocab": self.text.vocab_size,
            "num_valid": len(self.valid[0]),
            "preflight": scan,
        }

    def _rows(self, files: list[Path], split: str, process_index: int = 0, process_count: int = 1):
        """(row index, caption, codes) of one pass over files, for `split` and this host."""
        for file in files:
            for row, rb in self.read.record_batches(file, self.read.open(file)):
                rows = np.arange(row, row + rb.num_rows)
                codes = self.read.codes(file, row, rb.column(1))
                caps = self.read.captions(file, row, rb.column(0))
                keep = rows % process_count == process_index
                if self.valid_files is None:
                    held = _held_out(file, rows, self.cfg.valid_fraction)
                    keep &= held if split == "valid" else ~held
                for i in np.flatnonzero(keep):
                    yield int(rows[i]), caps[i], codes[i]

    def _preflight(self) -> tuple[list[str], dict]:
        """Read and check the first rows before anything is built: (their captions, a report of
        the data). Row counts come from the file footers; the rest from the rows read."""
        rows = sum(self.read.open(f).metadata.num_rows for f in self.files)
        captions, lo, hi, used = [], None, None, np.zeros(self.image_vocab, bool)
        for _, cap, codes in self._rows(self.files, "train"):
            captions.append(cap)
            lo = int(codes.min()) if lo is None else min(lo, int(codes.min()))
            hi = int(codes.max()) if hi is None else max(hi, int(codes.max()))
            used[codes] = True
            if len(captions) >= _SCAN_ROWS:
                break
        if not captions:
            raise ConfigError(
                f"data.path={self.cfg.path}: no training rows ({rows} rows in {len(self.files)} files, all held out "
                f"by data.valid_fraction={self.cfg.valid_fraction}?)"
            )
        blank = sum(not c.strip() for c in captions) / len(captions)
        report = {
            "rows": rows,
            "scanned": len(captions),
            "blank_captions": blank,
            "code_min": lo,
            "code_max": hi,
            "codes_used": int(used.sum()),
        }
        log.info(
            f"data: {rows:,} rows in {len(self.files)} file(s); of the first {len(captions):,} training rows "
            f"{blank:.1%} have a blank caption; codes {lo}..{hi}, {report['codes_used']:,} of {self.image_vocab:,} used"
        )
        if blank == 1.0 and not self.cfg.allow_blank_captions:
            raise ConfigError(
                f"data.path={self.cfg.path}: every caption of the first {len(captions):,} training rows is blank "
                f"(column {self.cfg.caption_column!r}); a model trained on it never sees text. Set "
                f"data.caption_column, or data.allow_blank_captions=true to train unconditionally"
            )
        return captions, report

    def _load_valid(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
        files = self.valid_files or self.files
        caps, codes = [], []
        for _, cap, c in self._rows(files, "valid"):
            caps.append(cap)
            codes.append(c)
            if len(caps) >= self.cfg.valid_max_rows:
                break
        if not caps and self.valid_files:
            raise ConfigError(
                f"data.valid_path={self.cfg.valid_path}: no rows in {', '.join(map(str, self.valid_files))}; "
                "give a split with rows, or drop data.valid_path to hold out data.valid_fraction of data.path"
            )
        if not caps:
            raise ConfigError(
                f"no validation rows: set data.valid_path or raise data.valid_fraction={self.cfg.valid_fraction}"
            )
        ids, mask = self.text.encode(caps)
        return ids, mask, np.stack(codes), caps

    # -- iterators ----------------------------------------------------------------------------
    def _stream(self, seed: int, process_index: int, process_count: int) -> Iterator[tuple[str, np.ndarray]]:
        """Endless shuffled rows: files in a new seeded order each epoch, through a shuffle buffer."""
        rng = np.random.default_rng([seed, 3])
        buf: list[tuple[str, np.ndarray]] = []
        epoch = 0
        while True:
            order = np.random.default_rng([seed, 4, epoch]).permutation(len(self.files))
            files = [self.files[i] for i in order]
            for _, cap, codes in self._rows(files, "train", process_index, process_count):
                if len(buf) < self.cfg.shuffle_buffer:
                    buf.append((cap, codes))
                    continue
                j = int(rng.integers(len(buf)))
                yield buf[j]
                buf[j] = (cap, codes)
            if epoch == 0 and not buf:
                raise ConfigError(f"data.path={self.cfg.path}: no training rows for this host")
            epoch += 1

    def train_batches(self, batch_size, seed, start_step=0, process_index=0, process_count=1) -> Iterator[Batch]:
        per_host = len(host_share(np.arange(batch_size), process_index, process_count))
        rows = self._stream(seed, process_index, process_count)
        for _ in range(start_step * per_host):  # resuming replays the stream without tokenising it
            next(rows)
        step = start_step
        while True:
            caps, codes = zip(*(next(rows) for _ in range(per_host)))
            ids, mask = self.text.encode(list(caps))
            batch = self.make_batch(ids, mask, np.stack(codes))
            yield self.blank_captions(batch, np.random.default_rng([seed, 2, step, process_index]))
            step += 1

    def eval_batches(self, batch_size: int, max_batches: Optional[int] = None) -> Iterator[Batch]:
        ids, mask, codes, _ = self.valid
        for idx, weights in eval_index_batches(len(codes), batch_size, max_batches):
            yield self.make_batch(ids[idx], mask[idx], codes[idx], weights)

    def demo_captions(self) -> list[str]:
        return [c for c in dict.fromkeys(self.valid[3]) if c][:6]

    def has_image_decoder(self) -> bool:
        return self.codebook is not None or self.vqgan is not None

    def valid_examples(self, n: int) -> tuple[list[str], np.ndarray]:
        return list(self.valid[3][:n]), self.valid[2][:n]

    def decode_images(self, codes: np.ndarray) -> Optional[np.ndarray]:
        if self.vqgan is not None:
            from dalle_ablate.vqgan.codes import decode_codes

            return decode_codes(self.vqgan, codes)
        return None if self.codebook is None else self.codebook.decode(codes)


def write_parquet(
    path: str | Path, captions: list[str], codes: np.ndarray, caption_column="caption", encoding_column="encoding"
) -> None:
    """Write (caption, codes) rows in dalle-mini's format."""
    table = pa.table(
        {
            caption_column: pa.array(captions, pa.string()),
            encoding_column: pa.array(list(map(list, codes)), pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, str(path))


@DATASETS.option("parquet", ParquetDataConfig)
def parquet(cfg: ParquetDataConfig, model_cfg) -> ParquetDataset:
    return ParquetDataset(cfg, model_cfg.text_len, model_cfg.image_len)
