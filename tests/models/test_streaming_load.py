"""The loader streams: host memory stays near one param's shards, never the model, and
in a multi-controller run each process reads only its own devices' shards.

Both run load_model in fresh processes (tests/models/load_worker.py): peak RSS is per
process, and jax.distributed must start before any device is touched."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hf_factory import make_tiny_hf_model
from jax.sharding import Mesh

from models.loader import load_model

WORKER = Path(__file__).with_name("load_worker.py")
MiB = 1 << 20

# A Llama whose largest params are 64 MiB in float32 (embed_tokens, lm_head, and the
# stacked q/o/gate/up/down), ~480 MiB in all.
D, V, L, F, N, K, H = 1024, 16384, 16, 1024, 16, 4, 64


def _write_checkpoint(path: Path) -> tuple[int, int]:
    """Sharded over several files with an index, as big checkpoints are. Returns
    (total bytes, largest served param's bytes)."""
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": D, "intermediate_size": F,
        "num_hidden_layers": L, "num_attention_heads": N, "num_key_value_heads": K, "head_dim": H,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    rng = np.random.default_rng(0)
    groups = [{"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}]
    for first in range(0, L, 4):
        group = {}
        for i in range(first, first + 4):
            p = f"model.layers.{i}."
            group |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                      p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
                      p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
                      p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                      p + "mlp.down_proj.weight": (D, F)}
        groups.append(group)
    index, total = {}, 0
    for n, group in enumerate(groups):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        # Distinct values per tensor (a constant would let a wrong-tensor bug pass), cheap to make.
        tensors = {k: np.full(shape, rng.standard_normal(), np.float32) for k, shape in group.items()}
        save_file(tensors, str(path / name))
        total += sum(t.nbytes for t in tensors.values())
        index |= dict.fromkeys(group, name)
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return total, V * D * 4


def _run_worker(*args) -> dict:
    out = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_stays_near_the_largest_param(tmp_path):
    total, largest = _write_checkpoint(tmp_path / "big")
    assert largest == 64 * MiB and total > 450 * MiB
    for dtype in ("float32", "bfloat16"):
        r = _run_worker("rss", tmp_path / "big", dtype)
        growth = r["peak"] - r["before"]
        # On the CPU backend the loaded params live in host memory too: what the loader
        # itself costs is the growth beyond them.
        overhead = growth - r["params_bytes"]
        print(f"\n{dtype}: checkpoint {total / MiB:.0f} MiB (largest param {largest / MiB:.0f} MiB); params "
              f"{r['params_bytes'] / MiB:.0f} MiB; peak RSS growth {growth / MiB:.0f} MiB, of which loader "
              f"overhead {overhead / MiB:.0f} MiB; {r['seconds']:.2f} s")
        assert overhead < 3 * largest + 64 * MiB
        if dtype == "bfloat16":  # never the model in float32 on the host: growth below the f32 checkpoint
            assert growth < 0.75 * total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_read_only_their_shards(tmp_path):
    path = make_tiny_hf_model(tmp_path / "m", "llama", vocab=1013, kv_heads=2, heads=8)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "model"))
    _arch, _g, state = load_model(path, mesh=mesh, dtype=jnp.float32, progress=False)
    expected = {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(state, nnx.Param))}
    np.savez(tmp_path / "expected.npz", **expected)
    ckpt_bytes = (path / "model.safetensors").stat().st_size
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = [subprocess.Popen([sys.executable, str(WORKER), "multiprocess", str(path), str(pid), str(port),
                               str(tmp_path / "expected.npz")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["kv_heads"] == 8 and r["shards_checked"] > 0
        # Split params are half this process's; only the small replicated ones are read whole.
        assert r["read_bytes"] < 0.7 * ckpt_bytes, (r, ckpt_bytes)
    print(f"\nbytes read per process: {[r['read_bytes'] for r in results]} of a {ckpt_bytes}-byte checkpoint")
