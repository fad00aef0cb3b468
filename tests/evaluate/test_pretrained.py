"""The FID Inception and CLIP ports: parity with torch-fidelity's and open_clip's own networks and
tokenizer given the same random weights (the `ref` extra; skipped only when torch is absent),
their converters, and FID reference statistics tagged with the weights that made them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from PIL import Image

from dalle_ablate.cli import main
from dalle_ablate.evaluate import clip, inception
from dalle_ablate.registry import ConfigError
from pretrained_weights import clip_file, inception_file
from torch_refs import open_clip_modules, torch_fidelity_inception


def images(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3)).astype(np.uint8)


def test_tf1_bilinear_resize_equals_torch_fidelitys():
    import torch

    torch_fidelity_inception()  # torch_fidelity importable beside this torchvision (tests/torch_refs.py)
    from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x

    x = images(2, 37, 50).astype(np.float32)
    theirs = (
        interpolate_bilinear_2d_like_tensorflow1x(
            torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), size=(299, 299), align_corners=False
        )
        .numpy()
        .transpose(0, 2, 3, 1)
    )
    np.testing.assert_allclose(np.asarray(inception.resize_tf1_bilinear(x, 299)), theirs, atol=1e-4, rtol=0)


def test_inception_equals_torch_fidelitys_extractor_with_the_same_weights(tmp_path):
    import torch

    tf = torch_fidelity_inception()
    # Random weights in torch-fidelity's state-dict layout, then batch norms calibrated on a
    # batch (running statistics = that batch's), so every layer's output is of order one.
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, s in inception.torch_names(nnx.eval_shape(lambda: inception.InceptionV3(nnx.Rngs(0)))).items():
        if name.endswith(("running_var", "bn.weight")):
            sd[name] = torch.rand(s.shape, generator=g) + 0.5
        elif name.endswith(("running_mean", "bias")):
            sd[name] = 0.1 * torch.randn(s.shape, generator=g)
        else:
            sd[name] = torch.randn(s.shape, generator=g) * (2.0 / np.prod(s.shape[1:])) ** 0.5
    sd["fc.weight"], sd["fc.bias"] = 0.01 * torch.randn(1008, 2048, generator=g), torch.zeros(1008)
    torch.save(sd, tmp_path / "random.pth")
    net = tf.FeatureExtractorInceptionV3(
        "inception-v3-compat", ["2048"], feature_extractor_weights_path=str(tmp_path / "random.pth")
    )
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = 1.0
    x = images(4, 48, 40)
    with torch.no_grad():
        net.train()
        net(torch.from_numpy(images(8, 80, 80, seed=1).transpose(0, 3, 1, 2).copy()))
        net.eval()
        theirs = net(torch.from_numpy(x.transpose(0, 3, 1, 2).copy()))[0].numpy()
    torch.save(net.state_dict(), tmp_path / "weights-inception.pth")

    main(["convert-inception", str(tmp_path / "weights-inception.pth"), str(tmp_path / "inception.npz")])
    ours = inception.InceptionFeatures(tmp_path / "inception.npz", batch_size=4)(x)
    assert ours.shape == (4, 2048) and theirs.std() > 0.1
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * np.abs(theirs).max(), rtol=0)


def test_clip_tokenizer_equals_open_clips_on_every_shipped_prompt():
    _, octok = open_clip_modules()
    from dalle_ablate.evaluate.prompts import PROMPT_LISTS

    ours = clip.CLIPTokenizer(clip.read_bpe(octok.default_bpe()))
    texts = [p.text for name in ("drawbench", "partiprompts", "shapesbench") for p in PROMPT_LISTS.get(name)()]
    texts += [
        "a \u201cquoted\u201d caf\u00e9 &amp;amp; 12 dogs' toys!!  ",
        "word " * 100,
        "\ufb01ne \uff46\uff55\uff4c\uff4c width",
        "",
    ]
    np.testing.assert_array_equal(ours(texts), octok.SimpleTokenizer()(texts).numpy())
    assert ours(["word " * 100])[0, -1] == ours.eot  # truncated to 77 with end-of-text kept last


@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_clip_equals_open_clips_model_with_the_same_weights(tmp_path, act):
    import torch

    ocm, octok = open_clip_modules()
    torch.manual_seed(0)
    ref = ocm.CLIP(
        embed_dim=32,
        quick_gelu=act == "quick_gelu",
        vision_cfg=ocm.CLIPVisionCfg(layers=2, width=64, patch_size=16, image_size=64, head_width=32),
        text_cfg=ocm.CLIPTextCfg(context_length=77, vocab_size=49408, width=64, heads=2, layers=2),
    ).eval()
    torch.save(ref.state_dict(), tmp_path / "clip.pt")
    main(
        [
            "convert-clip",
            str(tmp_path / "clip.pt"),
            str(tmp_path / "clip.npz"),
            "--bpe",
            octok.default_bpe(),
            "--act",
            act,
            "--head-width",
            "32",
        ]
    )
    scorer = clip.CLIPScorer(tmp_path / "clip.npz", batch_size=3)
    x = images(3, 64, 80)
    captions = ["a red circle", "two blue squares left of a green triangle", "A photo of a cat &amp; a dog"]
    with torch.no_grad():
        pixels = torch.from_numpy(scorer.preprocess(x).transpose(0, 3, 1, 2).copy())
        img, txt = ref.encode_image(pixels).numpy(), ref.encode_text(octok.SimpleTokenizer()(captions)).numpy()
    np.testing.assert_allclose(scorer.image_embeddings(x), img, atol=1e-5 * np.abs(img).max(), rtol=0)
    np.testing.assert_allclose(scorer.text_embeddings(captions), txt, atol=1e-5 * np.abs(txt).max(), rtol=0)
    cos = (img * txt).sum(-1) / np.linalg.norm(img, axis=-1) / np.linalg.norm(txt, axis=-1)
    np.testing.assert_allclose(scorer.scores(x, captions), 100 * cos, atol=1e-3)


def test_clip_score_clamps_the_mean_not_each_pair():
    """torchmetrics' CLIPScore: max(mean(100 * cos), 0). Pairs at cos 0.5 and -0.2 give 15, not
    the 25 of clamping each pair; pairs at 0.1 and -0.3 give 0."""
    from dalle_ablate.evaluate.clip import clip_score

    def pairs(*cosines):
        img = np.array([[1.0, 0.0]] * len(cosines))
        txt = np.array([[c, np.sqrt(1 - c * c)] for c in cosines]) * 3.0  # norms do not matter
        return img, txt

    assert clip_score(*pairs(0.5, -0.2)) == pytest.approx(15.0)
    assert clip_score(*pairs(0.1, -0.3)) == 0.0


@pytest.mark.parametrize("name,preset", [("ViT-B-32", "ViT-B/32"), ("ViT-L-14", "ViT-L/14")])
def test_presets_have_open_clips_parameter_shapes(name, preset):
    import importlib.resources

    import torch

    ocm, _ = open_clip_modules()
    cfg = json.loads((importlib.resources.files("open_clip") / "model_configs" / f"{name}.json").read_text())
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in ocm.CLIP(**cfg).state_dict().items() if k != "logit_scale"}
    ours = {
        k: tuple(v.shape)
        for k, v in clip.torch_names(nnx.eval_shape(lambda: clip.CLIP(clip.PRESETS[preset], nnx.Rngs(0)))).items()
    }
    assert ours == theirs
    assert clip.config_from_state_dict({k: np.empty(s, np.int8) for k, s in theirs.items()}) == clip.PRESETS[preset]


def test_fid_reference_is_tagged_with_its_weights_and_checked(tmp_path, optimized):
    # `optimized`: seven Inception passes at 299 px run faster with XLA's optimizations than at the
    # suite's -O0 (its one compile per batch shape costs more, but there are two): ~13 s less here.
    from dalle_ablate.evaluate.fid import Reference
    from dalle_ablate.evaluate.frechet import frechet_distance, statistics
    from dalle_ablate.weights import file_hash

    folder = tmp_path / "real"
    folder.mkdir()
    x = images(5, 32, 32)
    for i, im in enumerate(x):
        Image.fromarray(im).save(folder / f"{i}.png")
    Image.fromarray(images(1, 40, 24, seed=3)[0]).save(folder / "other_size.png")
    w = inception_file(tmp_path / "inception.npz")
    main(["fid-reference", "--weights", str(w), "--images", str(folder), "--out", str(tmp_path / "ref.npz")])
    ref = Reference.load(tmp_path / "ref.npz")
    net = inception.InceptionFeatures(w)
    assert (ref.n, ref.weights, ref.resize) == (6, file_hash(w), inception.RESIZE)
    feats = np.concatenate([net(x), net(images(1, 40, 24, seed=3))])  # sorted paths: 0..4.png, other_size.png
    mu, sigma = statistics(feats)
    np.testing.assert_allclose(ref.mu, mu, rtol=1e-6, atol=1e-9)
    # rank 5 in 2048 dimensions: the square roots of ~1e-16 eigenvalues add up to ~1e-5 of the trace
    assert frechet_distance(ref.mu, ref.sigma, mu, sigma) == pytest.approx(0.0, abs=1e-4 * np.trace(sigma))
    ref.check(net)
    # Without eval.reference the evaluator takes the real images of the eval prompts (once).
    from types import SimpleNamespace

    from dalle_ablate.evaluate.evaluators import EVALUATORS

    calls = []
    ctx = SimpleNamespace(
        cache={"fid": {"net": net, "reference": None}},
        dataset=SimpleNamespace(name="shapes"),
        reference_images=lambda: calls.append(1) or x,
    )
    same, other = EVALUATORS.get("fid").fn(x, ctx), EVALUATORS.get("fid").fn(x[::-1] // 2, ctx)
    assert same["fid"] == pytest.approx(0.0, abs=1e-4 * np.trace(sigma)) and other["fid"] > 100 * abs(same["fid"])
    assert (same["n"], same["reference_n"], same["weights"], calls) == (5, 5, net.hash, [1])
    stale = Reference(ref.mu, ref.sigma, ref.n, "0123456789abcdef", ref.resize, ref.source)
    with pytest.raises(
        ConfigError,
        match=rf"eval.reference: statistics of Inception weights 0123456789abcdef \({inception.RESIZE}\), "
        rf"but eval.fid.weights is {net.hash} \({inception.RESIZE}\)",
    ):
        stale.check(net)
    with pytest.raises(ConfigError, match=r"eval.fid.weights: .*clip.npz is not FID Inception weights"):
        inception.InceptionFeatures(clip_file(tmp_path / "clip.npz"))


def test_evaluators_name_their_missing_weights(tmp_path):
    # Checked with the run config, before any data is built or any weights are read.
    from conftest import run_config

    with pytest.raises(
        ConfigError, match=r"^eval.metrics has fid but eval.fid.weights is not set: give the FID Inception"
    ):
        run_config("eval.metrics=[fid]")
    with pytest.raises(
        ConfigError, match=r"^eval.metrics has clip but eval.clip.weights is not set: give CLIP weights"
    ):
        run_config("eval.metrics=[shapes,clip]")
    with pytest.raises(ConfigError, match=rf"^eval.clip.weights: {tmp_path}/nope.npz does not exist \(convert a CLIP"):
        run_config("eval.metrics=[clip]", f"eval.clip.weights={tmp_path}/nope.npz")
    weights = inception_file(tmp_path / "inception.npz")
    with pytest.raises(ConfigError, match=r"^eval.fid.batch_size=0 must be in \[1, inf\)$"):
        run_config("eval.metrics=[fid]", f"eval.fid.weights={weights}", "eval.fid.batch_size=0")
    with pytest.raises(ConfigError, match=rf"^eval.reference: {tmp_path}/stats.npz does not exist \(write one with"):
        run_config("eval.metrics=[fid]", f"eval.fid.weights={weights}", f"eval.reference={tmp_path}/stats.npz")
    # Settings of an evaluator not chosen are not checked: eval.fid stays unset without fid.
    assert run_config("eval.metrics=[shapes]").eval.fid.weights is None
    with pytest.raises(ConfigError, match=r"--bpe: .*nope.txt.gz does not exist"):
        clip.read_bpe("/nope.txt.gz")
