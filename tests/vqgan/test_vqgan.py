"""The Flax VQGAN: shapes of the f16_16384 layout, quantisation, weights round trips (our .npz and
taming-transformers' names), and `dalle-ablate encode --images` writing parquet the trainer reads."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from conftest import run_config
from dalle_ablate.registry import ConfigError
from dalle_ablate.vqgan import VQGAN, VQGANConfig, convert_state_dict, load_vqgan, save_vqgan
from dalle_ablate.vqgan.codes import decode_codes
from dalle_ablate.vqgan.model import torch_names

TINY = VQGANConfig(
    ch=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(8,), resolution=16, z_channels=4, embed_dim=4, n_embed=32
)


def images(n: int, size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3)).astype(np.uint8)


def test_f16_16384_layout_maps_256_px_to_16_by_16_codes():
    make = lambda: VQGAN(VQGANConfig(), nnx.Rngs(0))  # noqa: E731  (traced only: nothing is allocated)
    codes = jax.eval_shape(lambda x: make().encode(x), jax.ShapeDtypeStruct((2, 256, 256, 3), np.uint8))
    assert codes.shape == (2, 256) and codes.dtype == np.int32
    out = jax.eval_shape(lambda c: make().decode(c), codes)
    model = nnx.eval_shape(make)
    assert out.shape == (2, 256, 256, 3) and out.dtype == np.uint8
    names = torch_names(model)
    assert names["quantize.embedding.weight"].shape == (16384, 256)
    assert names["encoder.down.4.attn.1.q.weight"].shape == (512, 512, 1, 1)  # attention at 16 x 16 only
    assert not any(k.startswith("encoder.down.3.attn") for k in names)
    assert names["decoder.up.4.upsample.conv.weight"].shape == (512, 512, 3, 3)
    assert "decoder.up.0.upsample.conv.weight" not in names and "encoder.down.4.downsample.conv.weight" not in names


def test_codes_are_the_nearest_codebook_entries():
    model = VQGAN(TINY, nnx.Rngs(1))
    x = images(3)
    both = nnx.jit(lambda m, x: (m.quant_conv(m.encoder(x.astype(np.float32) / 127.5 - 1.0)), m.encode(x)))
    z, codes = both(model, x)
    z = np.asarray(z).reshape(3, -1, TINY.embed_dim)
    e = np.asarray(model.embedding[...], np.float64)
    want = np.argmin(((z[..., None, :].astype(np.float64) - e) ** 2).sum(-1), -1)
    assert np.array_equal(np.asarray(codes), want)
    # decoding the codes uses exactly those entries: two images with the same codes decode alike
    codes = np.asarray(codes)
    same = decode_codes(model, np.stack([codes[0], codes[0]]), batch=2)
    assert np.array_equal(same[0], same[1])


def test_weights_round_trip_through_npz_and_through_taming_names(tmp_path):
    model = VQGAN(TINY, nnx.Rngs(2))
    x = images(2)
    codes = np.asarray(model.encode(x))
    decoded = np.asarray(model.decode(codes))
    save_vqgan(model, tmp_path / "w.npz")
    for other in (load_vqgan(tmp_path / "w.npz"), convert_state_dict(torch_names(model), TINY)):
        assert np.array_equal(np.asarray(other.encode(x)), codes)
        assert np.array_equal(np.asarray(other.decode(codes)), decoded)
    sd = torch_names(model)
    del sd["decoder.conv_out.weight"]
    with pytest.raises(ConfigError, match=r"the checkpoint has no decoder.conv_out.weight"):
        convert_state_dict(sd, TINY)
    with pytest.raises(ConfigError, match=r"--vqgan: .*nope.npz does not exist"):
        load_vqgan(tmp_path / "nope.npz", "--vqgan")


def test_convert_vqgan_verb_reads_a_state_dict_npz(tmp_path, capsys):
    from dalle_ablate.cli import main

    model = VQGAN(TINY, nnx.Rngs(3))
    np.savez(tmp_path / "sd.npz", **torch_names(model))
    (tmp_path / "model.yaml").write_text(
        "model:\n  params:\n    embed_dim: 4\n    n_embed: 32\n    ddconfig:\n      ch: 8\n      ch_mult: [1, 2]\n"
        "      num_res_blocks: 1\n      attn_resolutions: [8]\n      resolution: 16\n      z_channels: 4\n"
        "      in_channels: 3\n      out_ch: 3\n      double_z: false\n      dropout: 0.0\n"
    )
    main(["convert-vqgan", str(tmp_path / "sd.npz"), str(tmp_path / "w.npz"), "--config", str(tmp_path / "model.yaml")])
    assert "32 codes, f2, 16 px" in capsys.readouterr().out
    x = images(2)
    assert np.array_equal(np.asarray(load_vqgan(tmp_path / "w.npz").encode(x)), np.asarray(model.encode(x)))


def test_encode_a_folder_of_captioned_images_into_parquet_the_trainer_reads(tmp_path, capsys):
    from dalle_ablate.cli import main
    from dalle_ablate.data import build_dataset

    model = VQGAN(TINY, nnx.Rngs(4))
    save_vqgan(model, tmp_path / "vq.npz")
    folder = tmp_path / "imgs"
    folder.mkdir()
    pics = images(9, size=24, seed=5)  # not square to the model's 16 px: resized and cropped
    captions = [f"picture number {i}" for i in range(9)]
    for i, (p, c) in enumerate(zip(pics, captions)):
        Image.fromarray(p[:, :20]).save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(c)
    main(
        [
            "encode",
            "--images",
            str(folder),
            "--vqgan",
            str(tmp_path / "vq.npz"),
            "--out",
            str(tmp_path / "pq"),
            "--batch",
            "4",
        ]
    )
    assert "data.vqgan_path=" in capsys.readouterr().out
    cfg = run_config(
        "data=parquet",
        f"data.path={tmp_path / 'pq' / 'data.parquet'}",
        "data.image_vocab=32",
        f"data.vqgan_path={tmp_path / 'vq.npz'}",
        "data.valid_fraction=0.3",
        "data.text_vocab_size=60",
        data=(),
    )
    ds = build_dataset(cfg.data, cfg.model)
    assert ds.image_len == 64 and ds.has_image_decoder()
    batch = next(ds.train_batches(4, seed=0))
    assert batch["codes"].shape == (4, 64) and batch["codes"].max() < 32
    assert ds.decode_images(batch["codes"]).shape == (4, 16, 16, 3)
    # the rows are the images' own codes
    from dalle_ablate.data.image_folder import load_square

    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "pq" / "data.parquet").to_pydict()
    assert table["caption"] == captions
    want = np.asarray(model.encode(np.stack([load_square(folder / f"{i:03d}.png", 16) for i in range(9)])))
    assert np.array_equal(np.array(table["encoding"]), want)
    (folder / "extra.png").write_bytes((folder / "000.png").read_bytes())
    with pytest.raises(SystemExit):
        main(["encode", "--images", str(folder), "--vqgan", str(tmp_path / "vq.npz"), "--out", str(tmp_path / "pq2")])
    assert "1 images have no caption file, e.g. extra.png needs extra.txt" in capsys.readouterr().err


def test_the_shapes_data_tokenized_by_a_vqgan_are_its_codes_of_the_renders(tmp_path):
    """data.tokenizer=vqgan: the registry's VQGAN option applied to the built-in renders."""
    from dalle_ablate.data.shapes import ShapesDataset, generate_split
    from dalle_ablate.registry import ConfigError
    from dalle_ablate.vqgan.codes import encode_images

    model = VQGAN(TINY, nnx.Rngs(2))
    save_vqgan(model, tmp_path / "vq.npz")
    base = [
        "data.tokenizer=vqgan",
        f"data.vqgan_path={tmp_path / 'vq.npz'}",
        "data.num_train=16",
        "data.num_valid=8",
        "data.num_test=8",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    cfg = run_config(*base, "data.image_size=16", "data.patch_size=2", "data.codebook_size=32", data=())
    ds = ShapesDataset(cfg.data, 24)
    assert (ds.image_len, ds.image_vocab, ds.tokenizer.grid) == (64, 32, (8, 8))
    renders = generate_split(cfg.data, "valid")[1]
    assert np.array_equal(ds.codes["valid"], encode_images(load_vqgan(tmp_path / "vq.npz"), renders))
    assert ds.decode_images(ds.codes["valid"]).shape == (8, 16, 16, 3)
    with pytest.raises(ConfigError, match=r"^data.vqgan_path needs data.image_size=16 \(got 48\)$"):
        ShapesDataset(run_config(*base, "data.patch_size=2", "data.codebook_size=32", data=()).data, 24)
