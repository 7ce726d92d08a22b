"""The decode step's FFN product kernel (interpret mode on the CPU): against its float32 definition on fresh random
inputs (fc1's folded LayerNorm, bias and ReLU; fc2's product split over K), per shard under tensor parallelism, and
lowered to Triton for an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.kernels.decode_matmul import applies, decode_matmul, decode_matmul_reference, split_for
from jaxrlhf.sharding import make_mesh


def inputs(M, K, N, dtype, seed):
    kx, kw, kc, kb = jax.random.split(jax.random.key(seed), 4)
    # rows with different means and spreads, so that the norm's centring and scaling both matter
    x = jax.random.normal(kx, (M, K)) * jnp.linspace(0.5, 3.0, M)[:, None] + jnp.linspace(-2.0, 2.0, M)[:, None]
    w = jax.random.normal(kw, (K, N)) / np.sqrt(K)
    return x.astype(dtype), w.astype(dtype), jax.random.normal(kc, (N,)) * 4, jax.random.normal(kb, (N,)).astype(dtype)


def stats(x):
    xf = x.astype(jnp.float32)
    return jnp.sum(xf, axis=-1), jnp.sum(xf * xf, axis=-1)


def test_how_k_is_split_and_which_shapes_apply():
    assert split_for(2048, 8192) == 1 and split_for(8192, 2048) == 4  # OPT-1.3B's fc1 (128 programs) and fc2 (128)
    assert split_for(1024, 128) == 4 and split_for(512, 128) == 2 and split_for(256, 128) == 1  # >= 2 blocks a share
    assert applies(64, 2048, 8192) and applies(16, 128, 64)
    assert not applies(48, 2048, 8192) and not applies(128, 2048, 8192)  # 16, 32 or 64 rows
    assert not applies(64, 2000, 8192) and not applies(64, 2048, 8100)  # whole blocks of K and N


@pytest.mark.parametrize("M, K, N, dtype", [(16, 256, 128, jnp.float32), (64, 512, 192, jnp.bfloat16)])
@pytest.mark.slow
def test_the_ffn_in_product_equals_the_definition(M, K, N, dtype):
    """fc1: the folded LayerNorm's end (from the rows' sums), the bias and the ReLU inside the kernel."""
    x, w, colsum, bias = inputs(M, K, N, dtype, seed=M + K)
    layer_norm = (*stats(x), colsum, 1e-5)
    got = decode_matmul(x, w, bias=bias, layer_norm=layer_norm, relu=True, interpret=True)
    assert got.dtype == dtype and got.shape == (M, N)
    want = decode_matmul_reference(x, w, bias=bias, layer_norm=layer_norm, relu=True)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol, rtol=tol)
    # one element by hand: relu((x w - mean(x) colsum) / sqrt(var(x) + eps) + b)
    xr, col = np.asarray(x[M - 1], np.float64), np.asarray(w[:, N - 1], np.float64)
    y = (xr @ col - xr.mean() * float(colsum[N - 1])) / np.sqrt(xr.var() + 1e-5) + float(bias[N - 1])
    np.testing.assert_allclose(float(got[M - 1, N - 1]), max(y, 0.0), atol=tol, rtol=tol)
    assert 0.1 < float(jnp.mean(got > 0)) < 0.9  # the ReLU cuts some of the outputs and keeps others
    # the mean term and the scale each matter: without either the answer is far off
    for wrong in [
        (jnp.zeros(M), layer_norm[1], colsum, 1e-5),
        (layer_norm[0], layer_norm[0] ** 2 / K + K, colsum, 1e-5),
    ]:
        off = decode_matmul_reference(x, w, bias=bias, layer_norm=wrong, relu=True)
        assert np.abs(np.asarray(off) - np.asarray(got, np.float32)).max() > 0.5


@pytest.mark.parametrize("M, K, N", [(32, 1024, 128), (16, 256, 64)])
def test_the_split_product_equals_the_definition(M, K, N):
    """fc2: no epilogue, K split (4 ways at 1024 x 128, none at 256 x 64) and the float32 partials summed."""
    x, w, _, _ = inputs(M, K, N, jnp.float32, seed=K)
    got = decode_matmul(x, w, interpret=True)
    assert got.dtype == jnp.float32 and got.shape == (M, N)
    np.testing.assert_allclose(np.asarray(got), np.asarray(decode_matmul_reference(x, w)), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        float(got[3, 5]), float(np.asarray(x[3], np.float64) @ np.asarray(w[:, 5], np.float64)), atol=1e-5, rtol=1e-5
    )


def test_per_shard_and_bad_shapes():
    """tp = 2 on 8 CPU devices (data 4 x model 2): fc1 on each shard's columns, fc2 on its rows of K, all-reduced."""
    mesh = make_mesh(tp=2)
    x, w, colsum, bias = inputs(64, 256, 256, jnp.float32, seed=7)
    layer_norm = (*stats(x), colsum, 1e-5)
    with jax.set_mesh(mesh):
        got = jax.jit(
            lambda x, w, b, s, q, c: decode_matmul(
                x, w, bias=b, layer_norm=(s, q, c, 1e-5), relu=True, interpret=True, mesh=mesh
            )
        )(x, w, bias, *layer_norm[:3])
        split = jax.jit(lambda x, w: decode_matmul(x, w, interpret=True, mesh=mesh))(x, w)
    want = decode_matmul_reference(x, w, bias=bias, layer_norm=layer_norm, relu=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(split), np.asarray(decode_matmul_reference(x, w)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"expected x \[M, K\] and w \[K, N\]"):
        decode_matmul(x, w[:128], interpret=True)
    with pytest.raises(ValueError, match="48 rows and a 256 x 256 matrix per shard; the kernel takes 16, 32, 64 rows"):
        decode_matmul(x[:48], w, interpret=True)
    with pytest.raises(ValueError, match="16 rows and a 96 x 256 matrix per shard"):  # rows / 4, K / 2 per shard
        jax.jit(lambda x, w: decode_matmul(x, w, interpret=True, mesh=mesh))(x[:, :192], w[:192])


def test_kernel_lowers_to_triton_for_an_h200():
    """OPT-1.3B's fc1 (LayerNorm, bias, ReLU) and fc2 (split four ways) at 64 rows, lowered for an abstract H200."""
    from jax import export
    from jax._src.mesh import AbstractDevice, AbstractMesh

    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    fc1 = jax.jit(
        lambda x, w, s, q, c, b: decode_matmul(x, w, bias=b, layer_norm=(s, q, c, 1e-5), relu=True, interpret=False)
    )
    fc2 = jax.jit(lambda x, w: decode_matmul(x, w, interpret=False))
    for fn, args, grid in [
        (fc1, (bf16(64, 2048), bf16(2048, 8192), f32(64), f32(64), f32(8192), bf16(8192)), (128, 1)),
        (fc2, (bf16(64, 8192), bf16(8192, 2048)), (32, 4)),
    ]:
        with jax.sharding.use_abstract_mesh(h200):
            exported = export.export(
                fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
            )(*args)
        module = exported.mlir_module()
        assert module.count('name = "jaxrlhf_decode_matmul"') == 1
        assert f"grid_x = {grid[0]} : i32, grid_y = {grid[1]} : i32" in module
