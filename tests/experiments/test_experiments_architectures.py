"""The real models' parameter lists: the published parameter counts, sensible flops."""

from __future__ import annotations

import pytest

from xgrad.experiments.architectures import ARCHITECTURES, bert_large, gpt2, resnet50


@pytest.mark.parametrize(
    ("name", "count"),
    [("resnet50", 25_557_032), ("bert-large", 335_141_888), ("gpt2", 124_439_808)],
)
def test_parameter_counts_match_the_published_models(name: str, count: int) -> None:
    assert sum(layer.numel for layer in ARCHITECTURES[name]()) == count


def test_forward_flops_per_sample() -> None:
    # ResNet-50 is about 4.1 GMACs at 224 x 224; transformers about 2 flops per
    # parameter and token outside attention.
    assert sum(layer.flops for layer in resnet50()) == pytest.approx(8.2e9, rel=0.03)
    bert = bert_large(seq=128)
    dense = sum(layer.flops for layer in bert if "attn" not in layer.name)
    encoder_params = sum(layer.numel for layer in bert if layer.name.startswith("encoder"))
    assert dense == pytest.approx(2 * encoder_params * 128, rel=0.01)
    assert gpt2()[-1].name == "lm_head (tied)" and gpt2()[-1].numel == 0
