"""The decode step's SwiGLU kernel (interpret mode on the CPU): against its float32 definition on fresh random
inputs, per shard under tensor parallelism, and lowered to Triton for an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.kernels.swiglu import rms_swiglu, rms_swiglu_reference
from jaxrlhf.sharding import make_mesh


def inputs(B, D, F, dtype, seed):
    kg, kh = jax.random.split(jax.random.key(seed))
    gate_up = (jax.random.normal(kg, (B, 2, F)) * 2).astype(dtype)
    h = (jax.random.normal(kh, (B, D)) * jnp.linspace(0.3, 3.0, B)[:, None]).astype(dtype)  # rows of different RMS
    return gate_up, h


@pytest.mark.parametrize(
    "B, D, F, dtype",
    [
        (3, 96, 80, jnp.float32),  # D in three pieces, one masked block
        (2, 64, 4500, jnp.float32),  # three blocks of 2048, the last masked
        (4, 128, 2048, jnp.bfloat16),
    ],
)
def test_kernel_equals_the_definition(B, D, F, dtype):
    gate_up, h = inputs(B, D, F, dtype, seed=B * 1000 + F)
    got = rms_swiglu(gate_up, h, 1e-5, interpret=True)
    want = rms_swiglu_reference(gate_up, h, 1e-5)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    # by hand for one element: r = 1 / sqrt(mean(h^2) + eps), silu(x) = x / (1 + e^-x)
    g, u, x = (np.asarray(a, np.float64) for a in (gate_up[B - 1, 0, F - 1], gate_up[B - 1, 1, F - 1], h[B - 1]))
    r = 1 / np.sqrt(np.mean(x * x) + 1e-5)
    np.testing.assert_allclose(float(got[B - 1, F - 1]), g * r / (1 + np.exp(-g * r)) * u * r, rtol=tol, atol=tol)
    # the scale matters: h's rows differ in RMS, so without it the answer is far off
    assert (
        np.abs(np.asarray(jax.nn.silu(gate_up[:, 0].astype(jnp.float32)) * gate_up[:, 1]) - np.asarray(got)).max() > 0.5
    )


def test_kernel_per_shard_and_bad_shapes():
    mesh = make_mesh(tp=2)  # 8 CPU devices: data 4 x model 2
    gate_up, h = inputs(4, 64, 96, jnp.float32, seed=5)
    got = jax.jit(lambda g, x: rms_swiglu(g, x, 1e-6, interpret=True, mesh=mesh))(gate_up, h)
    np.testing.assert_allclose(got, rms_swiglu_reference(gate_up, h, 1e-6), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"expected gate_up \[B, 2, F\] and h \[B, D\]"):
        rms_swiglu(gate_up.reshape(4, 192), h, 1e-6, interpret=True)


def test_kernel_lowers_to_triton_for_an_h200():
    """Llama-7B's shapes (F = 11008: the last block masked), lowered for an abstract H200 (no GPU needed)."""
    from jax import export
    from jax._src.mesh import AbstractDevice, AbstractMesh

    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    fn = jax.jit(lambda g, x: rms_swiglu(g, x, 1e-5, interpret=False))
    with jax.sharding.use_abstract_mesh(h200):
        exported = export.export(
            fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        )(jax.ShapeDtypeStruct((64, 2, 11008), jnp.bfloat16), jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16))
    module = exported.mlir_module()
    assert module.count('name = "jaxrlhf_rms_swiglu"') == 1 and "masked_swap" in module  # the last block's store
