"""The zoo: names, shapes, seeds, and torch and JAX twins computing the same function."""

from __future__ import annotations

import numpy as np
import pytest

from xgrad import models

torch = pytest.importorskip("torch")


def test_mlp_follows_the_shared_convention() -> None:
    w = models.init_weights("mlp", seed=0, dtype="float32")
    sizes = models.MLP_SIZES
    expected = []
    for i in range(len(sizes) - 1):
        expected += [
            (f"layers.{i}.weight", (sizes[i + 1], sizes[i])),
            (f"layers.{i}.bias", (sizes[i + 1],)),
        ]
    assert [(k, v.shape) for k, v in w.items()] == expected
    assert all(v.dtype == np.float32 for v in w.values())


@pytest.mark.parametrize("name", models.list_models())
def test_torch_named_parameters_match_the_spec(name: str) -> None:
    from xgrad.torch_backend.models import build

    w = models.init_weights(name, seed=3, dtype="float32")
    module = build(name, w)
    got = [(k, tuple(p.shape)) for k, p in module.named_parameters()]
    assert got == list(models.get_spec(name).params)
    for k, p in module.named_parameters():
        assert np.array_equal(p.detach().numpy(), w[k])


def test_seeds_are_deterministic_and_dtypes_round_the_same_numbers() -> None:
    a = models.init_weights("transformer", seed=7, dtype="float64")
    b = models.init_weights("transformer", seed=7, dtype="float64")
    c = models.init_weights("transformer", seed=8, dtype="float64")
    f32 = models.init_weights("transformer", seed=7, dtype="float32")
    bf16 = models.init_weights("transformer", seed=7, dtype="bfloat16")
    for k in a:
        assert np.array_equal(a[k], b[k])
        assert not np.array_equal(a[k], c[k])
        assert np.array_equal(f32[k], a[k].astype(np.float32))
        assert np.array_equal(bf16[k], a[k].astype(bf16[k].dtype))
    x1, y1 = models.make_batch("cnn", seed=1, batch_size=6, dtype="float16")
    x2, _ = models.make_batch("cnn", seed=1, batch_size=6, dtype="float16")
    assert x1.shape == (6, 1, 8, 8) and y1.shape == (6, 4) and x1.dtype == np.float16
    assert np.array_equal(x1, x2)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'resnet'.*cnn"):
        models.init_weights("resnet", 0)
    with pytest.raises(ValueError, match="batch_size=0"):
        models.make_batch("mlp", 0, 0)
    with pytest.raises(ValueError, match="dtype='int32'"):
        models.init_weights("mlp", 0, "int32")
    w = models.init_weights("mlp", 0)
    w["layers.0.bias"] = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match=r"layers.0.bias.*\(3,\), expected \(32,\)"):
        models.check_weights("mlp", w)
    del w["layers.2.bias"]
    with pytest.raises(ValueError, match=r"missing \['layers.2.bias'\]"):
        models.check_weights("mlp", w)
    with pytest.raises(ValueError, match="does not split evenly over world_size=3"):
        models.shard(np.zeros((4, 2)), 3, 1)


@pytest.mark.parametrize("name", models.list_models())
def test_torch_and_jax_twins_agree(name: str) -> None:
    """Same weights, same batch: losses and gradients agree to float32 rounding."""
    import jax

    from xgrad.jax_backend import models as jm
    from xgrad.torch_backend.models import build, loss, single_process_grads

    w = models.init_weights(name, seed=0, dtype="float32")
    x, y = models.make_batch(name, seed=0, batch_size=4, dtype="float32")
    module = build(name, w)
    value = loss(module(torch.from_numpy(x)), torch.from_numpy(y))
    value.backward()
    step = jax.jit(jax.value_and_grad(jm.make_loss(jm.get_apply(name))))
    jloss, jgrads = step(jm.to_params(w), x, y)
    exact = single_process_grads(name, w, x, y)
    assert float(jloss) == pytest.approx(value.item(), rel=1e-6)
    for k, p in module.named_parameters():
        scale = np.abs(exact[k]).max()
        assert p.grad is not None
        assert np.abs(p.grad.numpy() - exact[k]).max() <= 1e-5 * scale, k
        assert np.abs(np.asarray(jgrads[k]) - exact[k]).max() <= 1e-5 * scale, k


def test_single_process_grads_is_float64_and_matches_the_reference_backend() -> None:
    from xgrad.torch_backend.models import single_process_grads

    reference = pytest.importorskip("xgrad.reference")
    w = models.init_weights("mlp", 0, "float64")
    x, y = models.make_batch("mlp", 0, 8, "float64")
    ours = single_process_grads("mlp", w, x, y)
    theirs = reference.single_process_grads(w, x, y)
    for k in w:
        assert ours[k].dtype == np.float64
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-12, atol=1e-15)
