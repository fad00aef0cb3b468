"""Built-in shapes data, the tokenizers, and the parquet reader with its error messages."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_config
from dalle_ablate.data.base import host_share
from dalle_ablate.data.image_tokenizer import PatchCodebook, kmeans, unique_patches
from dalle_ablate.data.parquet import ParquetDataset, write_parquet
from dalle_ablate.data.scenes import MIXES, PALETTE, SHAPES, TIERS, position_name, random_scene, render, tier
from dalle_ablate.data.shapes import generate_split
from dalle_ablate.registry import ConfigError


def test_scenes_are_deterministic_and_splits_differ():
    cfg = run_config().data
    specs_a, images_a = generate_split(cfg, "valid")
    specs_b, images_b = generate_split(cfg, "valid")
    assert specs_a == specs_b and np.array_equal(images_a, images_b)
    specs_t, _ = generate_split(cfg, "test")
    assert [s["caption"] for s in specs_t] != [s["caption"] for s in specs_a]
    other, _ = generate_split(dataclasses.replace(cfg, seed=1), "valid")
    assert other != specs_a


@pytest.mark.parametrize("mix", MIXES)
def test_captions_state_what_the_scene_holds(mix):
    rng = np.random.default_rng(0)
    for _ in range(300):
        scene = random_scene(rng, mix=mix)
        cap = scene.caption
        assert 1 <= len(scene.objects) <= 3
        assert len({(o.row, o.col) for o in scene.objects}) == len(scene.objects)
        for o in scene.objects:
            if "color" in o.said:
                assert o.color in cap
            if "shape" in o.said:
                assert o.shape in cap
            if "size" in o.said:
                assert o.size in cap
            if "position" in o.said:
                assert position_name(o.row, o.col) in cap
        if scene.relation:
            a, b = scene.objects[scene.relation["subject"]], scene.objects[scene.relation["object"]]
            rel = scene.relation["rel"]
            assert {
                "left of": a.col < b.col,
                "right of": a.col > b.col,
                "above": a.row < b.row,
                "below": a.row > b.row,
            }[rel]
            assert re.search(rel.split()[0], cap)


@pytest.mark.parametrize(
    "mix, low, high, expected",
    [
        ("tiers", 1, 3, {"one": 1 / 4, "two": 1 / 4, "three": 1 / 4, "relation": 1 / 4}),
        ("tiers", 2, 3, {"two": 1 / 3, "three": 1 / 3, "relation": 1 / 3}),
        ("tiers", 2, 2, {"two": 1 / 2, "relation": 1 / 2}),
        # counts: the object count uniform, two objects in a relation 60% of the time
        ("counts", 1, 3, {"one": 1 / 3, "two": 0.4 / 3, "three": 1 / 3, "relation": 0.6 / 3}),
    ],
)
def test_scene_mixes_draw_each_tier_at_its_share(mix, low, high, expected):
    from scipy.stats import binomtest

    rng = np.random.default_rng(3)
    n = 4000
    seen = Counter(tier(random_scene(rng, low, high, mix).to_dict()) for _ in range(n))
    assert set(seen) == set(expected) and set(expected) <= set(TIERS)
    for name, share in expected.items():  # a two-sided exact test per tier; a wrong share fails it by far
        assert binomtest(seen[name], n, share).pvalue > 1e-4, (name, seen[name] / n, share)


def test_render_draws_each_object_in_its_colour_and_cell():
    rng = np.random.default_rng(1)
    for _ in range(20):
        scene = random_scene(rng)
        img = render(scene, 64).astype(int)
        for o in scene.objects:
            cy, cx = int((o.row + 0.5) * 64 / 3), int((o.col + 0.5) * 64 / 3)
            assert np.abs(img[cy, cx] - PALETTE[o.color]).max() <= 2
        # Anti-aliased: some edge pixels are blends, neither background nor a palette colour.
        colours = {tuple(c) for c in img.reshape(-1, 3)}
        assert len(colours) > len(scene.objects) + 1


def test_codebook_fit_is_deterministic_and_reconstructs_held_out_renders(small_dataset):
    cfg = run_config().data
    _, train = generate_split(cfg, "train")
    a = PatchCodebook.fit(train, cfg.patch_size, cfg.codebook_size, cfg.kmeans_patches, cfg.kmeans_iters, cfg.seed)
    b = PatchCodebook.fit(train, cfg.patch_size, cfg.codebook_size, cfg.kmeans_patches, cfg.kmeans_iters, cfg.seed)
    assert np.array_equal(a.codes, b.codes)
    _, test = generate_split(cfg, "test")  # never seen by the fit
    recon = a.decode(a.encode(test)).astype(np.float64)
    mse = np.mean((recon - test) ** 2)
    psnr = 10 * np.log10(255.0**2 / mse) if mse else np.inf  # exact at 48 px with a code per distinct patch
    assert psnr > 28.0, psnr
    # Encoding is nearest-code: no code is closer to any patch than the one chosen.
    patches, inverse, _ = unique_patches(test[:4], cfg.patch_size)
    chosen = a.encode(test[:4]).ravel()
    d = ((patches[:, None, :] - a.codes[None]) ** 2).sum(-1)
    assert np.allclose(d[inverse, chosen], d.min(1)[inverse], atol=1e-5)


def test_kmeans_matches_sklearn_lloyd():
    sklearn = pytest.importorskip("sklearn.cluster")
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(6, 5)) * 4
    x = (centres[rng.integers(6, size=600)] + rng.normal(size=(600, 5))).astype(np.float32)
    w = rng.integers(1, 5, size=600).astype(np.float32)
    ours = kmeans(x, w, 6, iters=30, seed=3)
    init = x[np.sort(np.random.default_rng(3).choice(600, size=6, replace=False))]
    ref = sklearn.KMeans(6, init=init, n_init=1, max_iter=30, tol=0, algorithm="lloyd").fit(x, sample_weight=w)
    assert np.allclose(ours, ref.cluster_centers_, atol=1e-4)


def test_shapes_batches_resume_and_host_shares(small_dataset):
    ds = small_dataset
    full = [b for _, b in zip(range(5), ds.train_batches(8, seed=0))]
    resumed = [b for _, b in zip(range(2), ds.train_batches(8, seed=0, start_step=3))]
    for a, b in zip(full[3:], resumed):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # Two hosts: their shares of every global batch are disjoint and together are that batch,
    # captions blanked identically; over an epoch the hosts together see every example once.
    n = len(ds.codes["train"])
    per_epoch = n // 8
    streams = [ds.train_batches(8, seed=0, process_index=i, process_count=2) for i in range(2)]
    seen = Counter()
    for step, single in zip(range(per_epoch), ds.train_batches(8, seed=0)):
        hosts = [next(s) for s in streams]
        for k in single:
            assert np.array_equal(np.concatenate([h[k] for h in hosts]), single[k]), (step, k)
        seen.update(row.tobytes() for h in hosts for row in h["codes"])
    available = Counter(row.tobytes() for row in ds.codes["train"])
    assert sum(seen.values()) == per_epoch * 8 and not seen - available  # nothing twice beyond the data's own repeats
    idx = np.arange(12)
    shares = [host_share(idx, i, 4) for i in range(4)]
    assert np.array_equal(np.sort(np.concatenate(shares)), idx)


def test_blank_captions_follow_the_probability(small_dataset):
    ds = small_dataset
    blank_ids, _ = ds.text.encode([""])
    batch = next(ds.train_batches(1000 if len(ds.codes["train"]) >= 1000 else 500, seed=5))
    frac = np.mean((batch["text"] == blank_ids).all(axis=1))
    assert abs(frac - ds.blank_caption_prob) < 0.05
    assert ds.text.decode(blank_ids) == [""]


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory, small_dataset):
    d = tmp_path_factory.mktemp("pq")
    ds = small_dataset
    write_parquet(d / "train.parquet", ds.captions["train"], ds.codes["train"])
    write_parquet(d / "valid.parquet", ds.captions["valid"], ds.codes["valid"])
    ds.tokenizer.save(d / "codebook.npz")
    ds.text.tok.save(str(d / "tokenizer.json"))
    return d


def parquet_cfg(path, **kw):
    base = run_config("data=parquet", f"data.path={path}", "data.image_vocab=145", data=()).data
    return dataclasses.replace(base, **kw)


def test_parquet_round_trip(parquet_dir, small_dataset):
    ds = small_dataset
    cfg = parquet_cfg(
        parquet_dir / "train.parquet",
        valid_path=str(parquet_dir / "valid.parquet"),
        tokenizer_path=str(parquet_dir / "tokenizer.json"),
        codebook_path=str(parquet_dir / "codebook.npz"),
        shuffle_buffer=1,
        blank_caption_prob=0.0,
    )
    pds = ParquetDataset(cfg, text_len=24, image_len=None)
    assert pds.image_len == ds.image_len
    ids, mask, codes, caps = pds.valid
    assert caps == ds.captions["valid"] and np.array_equal(codes, ds.codes["valid"])
    # With a buffer of one the stream is the file order of a single file: rows come back as written.
    b = next(pds.train_batches(8, seed=0))
    assert np.array_equal(b["codes"], ds.codes["train"][:8])
    assert pds.text.decode(b["text"]) == ds.text.decode(ds.text.encode(ds.captions["train"][:8])[0])
    assert np.array_equal(pds.decode_images(b["codes"]), ds.decode_images(ds.codes["train"][:8]))


def test_parquet_hash_split_and_hosts_are_disjoint_and_complete(parquet_dir):
    cfg = parquet_cfg(
        parquet_dir / "train.parquet", valid_fraction=0.1, tokenizer_path=str(parquet_dir / "tokenizer.json")
    )
    pds = ParquetDataset(cfg, text_len=24, image_len=None)
    f = pds.files
    train_rows = [r for r, _, _ in pds._rows(f, "train")]
    valid_rows = [r for r, _, _ in pds._rows(f, "valid")]
    n = pq.ParquetFile(f[0]).metadata.num_rows
    assert sorted(train_rows + valid_rows) == list(range(n)) and not set(train_rows) & set(valid_rows)
    assert 0.05 < len(valid_rows) / n < 0.15
    shares = [[r for r, _, _ in pds._rows(f, "train", i, 3)] for i in range(3)]
    assert sorted(sum(shares, [])) == train_rows
    assert all(not set(a) & set(b) for i, a in enumerate(shares) for b in shares[i + 1 :])


def _write(path, table):
    pq.write_table(table, str(path))
    return path


def test_parquet_errors_name_file_and_row(tmp_path, parquet_dir):
    tok = str(parquet_dir / "tokenizer.json")
    good = [[1] * 64, [2] * 64, [3] * 64]
    f = _write(tmp_path / "nocol.parquet", pa.table({"caption": ["a", "b", "c"], "codes": good}))
    with pytest.raises(
        ConfigError, match=re.escape(f"{f}: no column 'encoding' (columns: caption, codes); set data.encoding_column")
    ):
        ParquetDataset(parquet_cfg(f, tokenizer_path=tok), 24, 64)
    f = _write(
        tmp_path / "len.parquet", pa.table({"caption": ["a", "b", "c"], "encoding": [[1] * 64, [2] * 64, [3] * 60]})
    )
    with pytest.raises(ConfigError, match=re.escape(f"{f}: row 2: column 'encoding' has 60 codes, expected 64")):
        list(ParquetDataset(parquet_cfg(f, tokenizer_path=tok, valid_fraction=0.0), 24, 64)._rows([f], "train"))
    f = _write(
        tmp_path / "range.parquet",
        pa.table({"caption": ["a", "b", "c"], "encoding": [[1] * 64, [2] * 63 + [145], [3] * 64]}),
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(f"{f}: row 1: code 145 at position 63 is outside the codebook [0, 145) (data.image_vocab)"),
    ):
        ParquetDataset(parquet_cfg(f, tokenizer_path=tok), 24, 64)
    with pytest.raises(ConfigError, match=re.escape(f"data.path={tmp_path}/none*.parquet matches no parquet file")):
        ParquetDataset(parquet_cfg(f"{tmp_path}/none*.parquet"), 24, 64)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=re.escape(f"data.tokenizer_path={bad} is not a tokenizer.json")):
        ParquetDataset(parquet_cfg(parquet_dir / "train.parquet", tokenizer_path=str(bad)), 24, 64)


def _corrupt_middle(path):
    """Overwrite bytes of the second row group's pages; the footer stays intact."""
    meta = pq.ParquetFile(path).metadata
    rg = meta.row_group(1).column(0)
    start = rg.dictionary_page_offset or rg.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    return path


def _malformed(tmp_path, name):
    """Each malformed input as the issue (#14) found it; file -> (data overrides, expected message)."""
    codes = [[1] * 64, [2] * 64, [3] * 64]
    caps = ["a red circle", "a blue square", "a green triangle"]
    enc = pa.list_(pa.int64())
    tables = {
        "binary_captions": pa.table(
            {"caption": pa.array([c.encode() for c in caps], pa.binary()), "encoding": pa.array(codes, enc)}
        ),
        "bad_utf8": pa.table(
            {
                "caption": pa.array([b"ok", b"caf\xe9", b"ok"], pa.binary()).view(pa.string()),
                "encoding": pa.array(codes, enc),
            }
        ),
        "null_code": pa.table(
            {"caption": caps, "encoding": pa.array([[1] * 64, [2] * 30 + [None] + [2] * 33, [3] * 64], enc)}
        ),
        "null_list": pa.table({"caption": caps, "encoding": pa.array([[1] * 64, [2] * 64, None], enc)}),
        "float_codes": pa.table({"caption": caps, "encoding": pa.array([[1.5] * 64] * 3, pa.list_(pa.float64()))}),
        "string_codes": pa.table({"caption": caps, "encoding": pa.array([["1"] * 64] * 3, pa.list_(pa.string()))}),
        "scalar_codes": pa.table({"caption": caps, "encoding": pa.array([1, 2, 3], pa.int64())}),
        "all_blank": pa.table({"caption": pa.array([None, "", "  "], pa.string()), "encoding": pa.array(codes, enc)}),
        "negative_code": pa.table(
            {"caption": caps, "encoding": pa.array([[1] * 64, [2] * 64, [3] * 10 + [-1] + [3] * 53], enc)}
        ),
    }
    f = tmp_path / f"{name}.parquet"
    if name == "corrupt_middle":
        big = pa.table(
            {
                "caption": [f"a red circle {i}" for i in range(3000)],
                "encoding": pa.array([[i % 145] * 64 for i in range(3000)], enc),
            }
        )
        pq.write_table(big, str(f), row_group_size=1000)
        return _corrupt_middle(f)
    return _write(f, tables[name])


MALFORMED = {
    "binary_captions": "{f}: column 'caption' has type binary; captions must be UTF-8 strings (data.caption_column)",
    "bad_utf8": "{f}: row 1: column 'caption' is not valid UTF-8 (byte 3: b'\\xe9')",
    "null_code": "{f}: row 1: column 'encoding' has a null code at position 30",
    "null_list": "{f}: row 2: column 'encoding' is null (no codes)",
    "float_codes": "{f}: column 'encoding' holds double codes; codes must be integers in [0, 145)",
    "string_codes": "{f}: column 'encoding' holds string codes; codes must be integers in [0, 145)",
    "scalar_codes": "{f}: column 'encoding' has type int64; expected a list of integer codes per row (data.encoding_column)",
    "negative_code": "{f}: row 2: code -1 at position 10 is outside the codebook [0, 145) (data.image_vocab)",
    "all_blank": "data.path={f}: every caption of the first 3 training rows is blank (column 'caption'); a model trained on it "
    "never sees text. Set data.caption_column, or data.allow_blank_captions=true to train unconditionally",
    "corrupt_middle": "{f}: rows 1000..1999 (row group 1) cannot be read (corrupt file?): ",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_parquet_fails_in_one_line_naming_file_row_and_column(tmp_path, parquet_dir, name):
    f = _malformed(tmp_path, name)
    cfg = parquet_cfg(
        f, tokenizer_path=str(parquet_dir / "tokenizer.json"), valid_path=str(parquet_dir / "valid.parquet")
    )
    with pytest.raises(ConfigError) as err:
        ParquetDataset(cfg, 24, 64)
    msg = str(err.value)
    assert msg.startswith(MALFORMED[name].format(f=f)) and "\n" not in msg


def test_blank_captions_allowed_when_asked_and_the_preflight_report(tmp_path, parquet_dir):
    f = _malformed(tmp_path, "all_blank")
    cfg = parquet_cfg(
        f, tokenizer_path=str(parquet_dir / "tokenizer.json"), valid_path=str(f), allow_blank_captions=True
    )
    pds = ParquetDataset(cfg, 24, 64)
    assert pds.info["preflight"] == {
        "rows": 3,
        "scanned": 3,
        "blank_captions": 1.0,
        "code_min": 1,
        "code_max": 3,
        "codes_used": 3,
    }
    # On real data: the counts of the file written from the shapes set.
    pds = ParquetDataset(
        parquet_cfg(
            parquet_dir / "train.parquet",
            tokenizer_path=str(parquet_dir / "tokenizer.json"),
            valid_path=str(parquet_dir / "valid.parquet"),
        ),
        24,
        None,
    )
    codes = pq.read_table(parquet_dir / "train.parquet").column("encoding").combine_chunks().flatten().to_numpy()
    rep = pds.info["preflight"]
    assert rep["rows"] == rep["scanned"] == pq.ParquetFile(parquet_dir / "train.parquet").metadata.num_rows
    assert (rep["code_min"], rep["code_max"], rep["codes_used"]) == (codes.min(), codes.max(), len(np.unique(codes)))
    assert rep["blank_captions"] == 0.0


def test_scene_specs_are_kept_as_json(small_dataset):
    spec = small_dataset.specs["valid"][0]
    assert json.loads(json.dumps(spec)) == spec
    assert {"objects", "caption", "relation"} <= set(spec)
    assert all(o["shape"] in SHAPES and o["color"] in PALETTE for o in spec["objects"])


def test_an_empty_valid_split_is_named(tmp_path, parquet_dir):
    empty = tmp_path / "valid.parquet"
    write_parquet(empty, [], np.zeros((0, 64), np.int64))
    cfg = parquet_cfg(
        parquet_dir / "train.parquet", valid_path=str(empty), tokenizer_path=str(parquet_dir / "tokenizer.json")
    )
    with pytest.raises(ConfigError) as err:
        ParquetDataset(cfg, 24, None)
    assert str(err.value) == (
        f"data.valid_path={empty}: no rows in {empty}; give a split with rows, or drop data.valid_path "
        "to hold out data.valid_fraction of data.path"
    )
