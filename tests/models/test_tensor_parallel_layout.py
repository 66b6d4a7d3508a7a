"""Any tensor_parallel_size the heads allow: the vocabulary is padded to a multiple of
tp and KV heads are replicated when tp exceeds them; every param is read straight
into its shards, and the model computes what it computes at tp=1."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_factory import make_tiny_hf_model
from jax.sharding import Mesh

from models.loader import load_model
from models.sharding import checkpoint_arch

VOCAB = 1013  # prime: no tp > 1 divides it
# name -> (factory kwargs, tensor-parallel sizes); qwen2: q/k/v biases, tied embeddings;
# phi3: fused projections.
MODELS = {
    "llama": (dict(arch="llama", vocab=VOCAB, kv_heads=2, heads=8), (1, 2, 4, 8)),
    "qwen2-tied": (dict(arch="qwen2", vocab=VOCAB, kv_heads=2, heads=4, tie=True), (1, 2, 4)),
    # fused qkv_proj / gate_up_proj read as row blocks, KV heads replicated past tp = 2
    "phi3": (dict(arch="phi3", vocab=VOCAB, kv_heads=2, heads=8), (1, 2, 4, 8)),
}


def mesh_of(tp):
    return Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))


def dense_causal_attention(q, k, v, kv_cache, layer, md):
    """One sequence, no cache: query head n attends with KV head n // (N / K), as the
    serving kernels group heads. q: [T, N, H]; k, v: [T, K, H] -> [T, N, H]."""
    n, kh = q.shape[1], k.shape[1]
    k, v = jnp.repeat(k, n // kh, axis=1), jnp.repeat(v, n // kh, axis=1)
    s = jnp.einsum("tnh,snh->nts", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((q.shape[0], q.shape[0]), bool)), s, -jnp.inf)
    return jnp.einsum("nts,snh->tnh", jax.nn.softmax(s, axis=-1), v), kv_cache


def forward_logits(graphdef, state, ids):
    @jax.jit
    def run(state, ids):
        model = nnx.merge(graphdef, state)
        hidden, _ = model(ids, jnp.arange(ids.shape[0]), None, None, dense_causal_attention)
        return model.compute_logits(hidden)

    return np.asarray(run(state, ids))


def served_layout(x, dims, arch):
    """The tp=1 param as served: zero rows up to the padded vocabulary, each KV head's
    block of head_dim columns repeated kv_head_replicas times."""
    for axis, dim in enumerate(dims):
        if dim == "padded_vocab_size":
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, arch.padded_vocab_size - arch.vocab_size)
            x = np.pad(x, pad)
        elif dim == "num_key_value_heads*head_dim":
            heads = x.reshape(*x.shape[:axis], -1, arch.head_dim, *x.shape[axis + 1:])
            x = np.repeat(heads, arch.kv_head_replicas, axis=axis).reshape(*x.shape[:axis], -1, *x.shape[axis + 1:])
    return x


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    out = {}
    for name, (kw, sizes) in MODELS.items():
        path = make_tiny_hf_model(tmp_path_factory.mktemp(name), **kw)
        out[name] = path, {tp: load_model(path, mesh=mesh_of(tp), dtype=jnp.float32, progress=False) for tp in sizes}
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_effective_arch_shards_and_logits(loaded, name):
    _path, by_tp = loaded[name]
    arch1, graphdef1, state1 = by_tp[1]
    ref1 = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(state1, nnx.Param))}
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, 12), jnp.int32)
    logits1 = forward_logits(graphdef1, state1, ids)
    assert logits1.shape == (12, VOCAB)
    k = arch1.num_key_value_heads
    for tp, (arch, graphdef, state) in by_tp.items():
        replicas = max(tp // k, 1)
        assert arch.vocab_size == VOCAB and arch.padded_vocab_size == -(-VOCAB // tp) * tp
        assert (arch.num_key_value_heads, arch.kv_head_replicas) == (k * replicas, replicas)
        assert checkpoint_arch(arch) == arch1
        for keys, var in nnx.to_flat_state(nnx.state(state, nnx.Param)):
            x = var[...]
            spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
            # Each device holds 1/tp of a split param and all of a replicated one.
            want = tuple(n // tp if s == "model" else n for n, s in zip(x.shape, spec))
            assert len(x.addressable_shards) == tp
            for shard in x.addressable_shards:
                assert shard.data.shape == want, (keys, tp)
                assert shard.data.nbytes == x.nbytes // (tp if "model" in spec else 1)
            # The served layout is the tp=1 param, padded with zero rows / KV head blocks repeated.
            w = type(nnx.merge(graphdef, state)).weight_map(arch)[keys[-1]]
            np.testing.assert_array_equal(np.asarray(x), served_layout(ref1[keys], w.dims, arch),
                                          err_msg=f"{keys} tp={tp}")
        logits = forward_logits(graphdef, state, ids)
        assert logits.shape == (12, VOCAB)  # the padding's logits are cut off
        np.testing.assert_allclose(logits, logits1, rtol=1e-5, atol=1e-5, err_msg=f"tp={tp}")


def test_invalid_tensor_parallel_size_names_the_valid_ones(loaded):
    path, _ = loaded["llama"]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=8; "
                                         "valid sizes for this model: 1, 2, 4, 8"):
        load_model(path, mesh=mesh_of(3), dtype=jnp.float32, progress=False)


def test_bf16_checkpoint_casts_on_the_way(tmp_path):
    """safetensors bf16 comes back as ml_dtypes bfloat16: loaded as f32 it is exact, as
    bf16 it is the same bits."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    f32 = make_tiny_hf_model(tmp_path / "f32", "llama", vocab=VOCAB)
    bf16 = tmp_path / "bf16"
    transformers.AutoModelForCausalLM.from_pretrained(f32).to(torch.bfloat16).save_pretrained(bf16)
    stored = load_file(str(bf16 / "model.safetensors"))["model.layers.1.self_attn.k_proj.weight"]
    assert stored.dtype.name == "bfloat16"
    for dtype in (jnp.float32, jnp.bfloat16):
        _arch, _g, state = load_model(bf16, mesh=mesh_of(2), dtype=dtype, progress=False)
        k = state["layers"]["k_proj"][...]
        assert k.dtype == dtype
        np.testing.assert_array_equal(np.asarray(k[1]).astype(np.float32), stored.T.astype(np.float32))


def test_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = make_tiny_hf_model(tmp_path / "m", "llama")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="the checkpoint has no tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(path, mesh=mesh_of(1), dtype=jnp.float32, progress=False)
