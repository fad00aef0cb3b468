"""The model-family contract (model/family.py): every registered family provides each member the
sampler, the trainer and the cost accounting read, and a class that lacks one is refused by name."""

from __future__ import annotations

import pytest

from conftest import run_config
from dalle_ablate.model import FAMILIES, abstract_model, resolve
from dalle_ablate.model.family import Family, FamilyCosts, family, members, missing


def test_the_protocols_list_what_the_sampler_trainer_and_cost_accounting_read():
    assert set(members(Family)) == {
        "bos_id",
        "image_vocab",
        "logit_rows",
        "encode",
        "start_decoding",
        "decode_step",
        "__call__",
        "nll",
        "STACKS",
        "COSTS",
    }
    assert set(members(FamilyCosts)) == {
        "forward_flops",
        "activation_elements",
        "logit_elements",
        "model_axis_reductions",
    }


@pytest.mark.parametrize("name", sorted(FAMILIES.names()))
def test_every_registered_family_implements_every_member(name):
    cls = FAMILIES.get(name)
    assert missing(cls, Family) == [] and missing(cls.COSTS, FamilyCosts) == []
    assert family(cls) is cls
    for stack, layer in cls.STACKS.items():
        assert layer.BRANCHES, stack  # per-resblock gradient scaling reads each layer's branches
    preset = {"seq2seq": ["model=preln"], "single_stream": ["model=dalle", "model.conv_kernel=3"]}.get(
        name, [f"model.family={name}"]
    )
    model = abstract_model(resolve(run_config(*preset).model, image_len=16, image_vocab=30, text_vocab=40))
    for attribute in ("bos_id", "image_vocab", "logit_rows"):  # instance attributes: the built model has them
        assert isinstance(getattr(model, attribute), int), attribute
    for stack in cls.STACKS:
        assert len(getattr(model, stack)) > 0, stack


def test_a_family_missing_a_member_is_refused_naming_it():
    seq2seq = FAMILIES.get("seq2seq")

    class Partial:
        bos_id: int
        image_vocab: int
        logit_rows: int
        STACKS = seq2seq.STACKS
        COSTS = seq2seq.COSTS
        encode = seq2seq.encode
        start_decoding = seq2seq.start_decoding
        __call__ = seq2seq.__call__
        nll = seq2seq.nll

    assert missing(Partial, Family) == ["decode_step"]
    with pytest.raises(
        TypeError, match=r"model family Partial does not provide decode_step \(model/family.py: Family\)"
    ):
        family(Partial)

    class Costs:
        forward_flops = activation_elements = logit_elements = staticmethod(lambda cfg, t=1: 0)

    Partial.decode_step = seq2seq.decode_step
    Partial.COSTS = Costs
    with pytest.raises(TypeError, match=r"does not provide COSTS.model_axis_reductions"):
        family(Partial)
