"""The pooling runner against HF (float32, tiny random checkpoints; docs/pooling.md):
embeddings of a Qwen3 embedder (last token, normalized) and a Llama embedder with a
sentence-transformers layout (mean, normalized; CLS through --pooler-config), carried
across prefill chunks; Matryoshka dimensions; a Qwen3 classifier's probabilities and
reward scores; a Llama cross-encoder's scores and ranking; cosine scores of an
embedding model; no compile after the warm-up; every bad input a clear error."""
import numpy as np
import pytest
import torch
import transformers
from compile_counter import count_compiles
from pooling_factory import make_pooling_model

from jaxserve import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.slow
LENGTHS = [1, 5, 16, 17, 40, 100]


def prompts(seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def make_llm(path, **kw):
    # 32-token steps: the 40- and 100-token prompts take 2 and 4 chunks.
    base = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory=4 << 20,
                compilation_cache=False, progress=False, dtype="float32", enforce_eager=True)
    return LLM(str(path), **(base | kw))


def hf_hidden(path, ids):
    model = transformers.AutoModel.from_pretrained(path).float().eval()
    with torch.no_grad():
        return [model(torch.tensor([x])).last_hidden_state[0].numpy() for x in ids]


def unit(x):
    return x / np.linalg.norm(x)


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory):
    return make_pooling_model(tmp_path_factory.mktemp("q3emb"), "qwen3", is_matryoshka=True)


@pytest.fixture(scope="module")
def llama_st(tmp_path_factory):
    return make_pooling_model(tmp_path_factory.mktemp("llst"), "llama", st_pooling="mean")


def test_last_token_embedder_equals_hf(qwen3_embedder):
    llm = make_llm(qwen3_embedder)
    assert llm.config.model_config.pooler_config.pooling_type == "LAST"
    ids = prompts()
    outs = llm.embed([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    for x, o, h in zip(ids, outs, hf_hidden(qwen3_embedder, ids)):
        assert o.prompt_token_ids == x
        np.testing.assert_allclose(o.outputs.embedding, unit(h[-1]), atol=1e-5)
    # encode: the same state unnormalized; Matryoshka: the first k values, then normalized.
    raw = llm.encode([{"prompt_token_ids": ids[3]}], use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(raw, hf_hidden(qwen3_embedder, [ids[3]])[0][-1], atol=1e-5)
    short = llm.embed({"prompt_token_ids": ids[3]}, PoolingParams(dimensions=16), use_tqdm=False)[0]
    np.testing.assert_allclose(short.outputs.embedding, unit(raw[:16]), atol=1e-6)
    plain = llm.embed({"prompt_token_ids": ids[3]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    np.testing.assert_allclose(plain.outputs.embedding, raw, atol=1e-6)
    # Cosine scores of an embedding model, 1:N.
    scores = llm.score({"prompt_token_ids": ids[2]}, [{"prompt_token_ids": x} for x in ids[3:]], use_tqdm=False)
    want = [float(unit(raw_a) @ unit(raw_b)) for raw_a, raw_b in
            [(hf_hidden(qwen3_embedder, [ids[2]])[0][-1], h[-1]) for h in hf_hidden(qwen3_embedder, ids[3:])]]
    np.testing.assert_allclose([s.outputs.score for s in scores], want, atol=1e-5)
    # Errors: generation on a pooling model; a classifier's task; dimensions past the model's.
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("w3 w4", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="not served by this model"):
        llm.classify("w3 w4", use_tqdm=False)
    with pytest.raises(ValueError, match="at most the model's 64"):
        llm.embed("w3 w4", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.embed({"prompt_token_ids": [5] * 129}, use_tqdm=False)
    kept = llm.encode({"prompt_token_ids": list(range(3, 203))}, truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert kept.prompt_token_ids == list(range(183, 203))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(["w3", "w4"], ["w5", "w6", "w7"], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_causal_lm_config_over_model_tensors(tmp_path, qwen3_embedder):
    """Qwen3-Embedding's layout: config.json says Qwen3ForCausalLM, the tensors are Qwen3Model's."""
    import json
    import shutil

    path = tmp_path / "q3e"
    shutil.copytree(qwen3_embedder, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    llm = make_llm(path)  # runner auto: pooling
    assert llm.config.model_config.pooler_config.task == "embed"
    x = prompts(7, [12])[0]
    h = hf_hidden(qwen3_embedder, [x])[0][-1]
    np.testing.assert_allclose(llm.embed({"prompt_token_ids": x}, use_tqdm=False)[0].outputs.embedding, unit(h),
                               atol=1e-5)


def test_mean_and_cls_carried_across_chunks(llama_st):
    """The sentence-transformers layout says mean + Normalize; CLS by --pooler-config."""
    ids = prompts(1)
    hidden = hf_hidden(llama_st, ids)
    llm = make_llm(llama_st)
    pc = llm.config.model_config.pooler_config
    assert (pc.pooling_type, pc.normalize) == ("MEAN", True)
    assert not llm.config.cache_config.enable_prefix_caching  # every token's state is needed
    outs = llm.embed([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    for o, h in zip(outs, hidden):
        np.testing.assert_allclose(o.outputs.embedding, unit(h.mean(0)), atol=1e-5)
    del llm
    llm = make_llm(llama_st, pooler_config={"pooling_type": "cls", "normalize": False})
    outs = llm.embed([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    for o, h in zip(outs, hidden):
        np.testing.assert_allclose(o.outputs.embedding, h[0], atol=1e-5)
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed("w3", PoolingParams(dimensions=8), use_tqdm=False)


def test_classifier_and_reward_equal_hf(tmp_path):
    path = make_pooling_model(tmp_path / "cls", "qwen3", "classifier", num_labels=3)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).float().eval()
    ids = prompts(2)
    with torch.no_grad():
        logits = [hf(torch.tensor([x])).logits[0].numpy() for x in ids]
    llm = make_llm(path)
    assert llm.config.model_config.pooler_config.task == "classify"
    outs = llm.classify([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    for o, lg in zip(outs, logits):
        e = np.exp(lg - lg.max())
        np.testing.assert_allclose(o.outputs.probs, e / e.sum(), atol=1e-5)
        assert o.outputs.num_classes == 3
    rewards = llm.reward([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    np.testing.assert_allclose(np.stack([r.outputs.data for r in rewards]), np.stack(logits), atol=1e-4)
    with pytest.raises(ValueError, match="one label"):
        llm.score("w3", "w4", use_tqdm=False)
    with pytest.raises(ValueError, match="not served by this model"):
        llm.embed("w3", use_tqdm=False)


def test_cross_encoder_scores_and_ranking(tmp_path):
    path = make_pooling_model(tmp_path / "ce", "llama", "classifier", num_labels=1)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).float().eval()
    rng = np.random.default_rng(3)
    query = " ".join(f"w{i}" for i in rng.integers(3, 500, 6))
    docs = [" ".join(f"w{i}" for i in rng.integers(3, 500, n)) for n in (4, 9, 30, 50)]
    with torch.no_grad():
        want = [float(torch.sigmoid(hf(torch.tensor([tok(query, text_pair=d)["input_ids"]])).logits[0, 0]))
                for d in docs]
    llm = make_llm(path)
    got = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.argsort(got).tolist() == np.argsort(want).tolist()
    pairwise = llm.score([query, docs[0]], [docs[1], docs[2]], use_tqdm=False)  # N:N
    assert len(pairwise) == 2


def test_no_compiles_after_warmup(qwen3_embedder):
    llm = make_llm(qwen3_embedder, enforce_eager=False, token_buckets=[16, 32], request_buckets=[8])
    runner = llm.llm_engine.model_runner
    assert runner.num_compiled_programs == 4  # a model step and a pooling head per token bucket
    with count_compiles(runner) as counts:
        llm.embed([{"prompt_token_ids": x} for x in prompts(4)], use_tqdm=False)
        llm.embed({"prompt_token_ids": [7, 8]}, use_tqdm=False)
    assert counts == [0, 0]


def test_runner_settings_errors(tmp_path, qwen3_embedder, tiny_models):
    with pytest.raises(ValueError, match="needs a \\*ForSequenceClassification"):
        make_llm(qwen3_embedder, convert="classify")
    with pytest.raises(ValueError, match="is a pooling model"):
        make_llm(qwen3_embedder, runner="generate")
    with pytest.raises(ValueError, match="unknown key"):
        make_llm(qwen3_embedder, pooler_config={"pooling": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        make_llm(qwen3_embedder, pooler_config={"pooling_type": "MAX"})
    gen = make_llm(tiny_models("llama"))
    with pytest.raises(ValueError, match="runner='generate'"):
        gen.embed("w3 w4", use_tqdm=False)
    # A causal LM served as an embedding model: its last hidden state (the lm_head unused).
    emb = make_llm(tiny_models("llama"), runner="pooling")
    assert emb.config.model_config.pooler_config.task == "embed"
    causal = transformers.AutoModelForCausalLM.from_pretrained(tiny_models("llama")).float().eval()
    x = prompts(5, [20])[0]
    with torch.no_grad():
        h = causal(torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
    np.testing.assert_allclose(emb.embed({"prompt_token_ids": x}, use_tqdm=False)[0].outputs.embedding, unit(h),
                               atol=1e-5)


def test_bert_and_xlmr_encoders(tmp_path):
    """BERT with a sentence-transformers layout (mean + Normalize) against
    SentenceTransformer; XLM-R (positions from padding_idx + 1) pooled with CLS
    against HF; an XLM-R cross-encoder against HF's; a ragged batch of prompts of 1 to
    100 tokens in one step."""
    import sentence_transformers

    bert = make_pooling_model(tmp_path / "bert", "bert", st_pooling="mean")
    ids = prompts(6)
    llm = make_llm(bert, max_num_batched_tokens=512)
    assert not llm.config.scheduler_config.enable_chunked_prefill  # a whole prompt per step
    outs = llm.embed([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    st = sentence_transformers.SentenceTransformer(str(bert), device="cpu")
    st.tokenizer.pad_token = "<unk>"  # one text per batch: nothing is padded
    want = st.encode([" ".join(f"w{t}" for t in x) for x in ids], batch_size=1)
    for o, w in zip(outs, want):
        np.testing.assert_allclose(o.outputs.embedding, w, atol=2e-5)
    del llm

    xlmr = make_pooling_model(tmp_path / "xlmr", "xlmr")
    llm = make_llm(xlmr, max_num_batched_tokens=512)
    assert llm.config.model_config.pooler_config.pooling_type == "CLS"
    outs = llm.embed([{"prompt_token_ids": x} for x in ids], PoolingParams(normalize=False), use_tqdm=False)
    for o, h in zip(outs, hf_hidden(xlmr, ids)):
        np.testing.assert_allclose(o.outputs.embedding, h[0], atol=2e-5)
    del llm

    ce = make_pooling_model(tmp_path / "xlmr_ce", "xlmr", "classifier", num_labels=1)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(ce).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(ce)
    docs = ["w5 w6", "w7 w8 w9 w10", "w11", "w12 w13 w14 w15 w16 w17 w18"]
    with torch.no_grad():
        want = [float(torch.sigmoid(hf(torch.tensor([tok("w3 w4", text_pair=d)["input_ids"]])).logits[0, 0]))
                for d in docs]
    llm = make_llm(ce, max_num_batched_tokens=512)
    got = [s.outputs.score for s in llm.score("w3 w4", docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=2e-5)
    with pytest.raises(ValueError, match="whole prompt in one step"):
        make_llm(ce, max_num_batched_tokens=64)


def test_bert_cross_encoder_token_types(tmp_path):
    """A BERT cross-encoder (pooler + classifier) against HF's on pairs, whose second
    text has token type 1: scores (sigmoid of one label) and a 3-label classifier's
    probabilities, within 1e-4 (float32); the types change the scores."""
    docs = ["w5 w6", "w7 w8 w9 w10", "w11", "w12 w13 w14 w15 w16 w17 w18"]
    for labels in (1, 3):
        ce = make_pooling_model(tmp_path / f"bert_ce{labels}", "bert", "classifier", num_labels=labels)
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(ce).float().eval()
        tok = transformers.AutoTokenizer.from_pretrained(ce)
        enc = [tok("w3 w4", text_pair=d, return_tensors="pt") for d in docs]
        assert all(e["token_type_ids"].sum() > 0 for e in enc)
        with torch.no_grad():
            logits = [hf(**e).logits[0] for e in enc]
            untyped = [hf(e["input_ids"]).logits[0] for e in enc]
        llm = make_llm(ce, max_num_batched_tokens=512)
        if labels == 1:
            got = [s.outputs.score for s in llm.score("w3 w4", docs, use_tqdm=False)]
            want = [float(torch.sigmoid(x[0])) for x in logits]
            np.testing.assert_allclose(got, want, atol=1e-4)
            assert max(abs(g - float(torch.sigmoid(u[0]))) for g, u in zip(got, untyped)) > 1e-3
        else:
            got = [o.outputs.probs for o in llm.classify([("w3 w4", d) for d in docs], use_tqdm=False)]
            np.testing.assert_allclose(got, [torch.softmax(x, -1).numpy() for x in logits], atol=1e-4)
            # A single text has no second segment: token types all 0, as HF.
            one = llm.classify("w3 w4 w5", use_tqdm=False)[0]
            with torch.no_grad():
                want = torch.softmax(hf(**tok("w3 w4 w5", return_tensors="pt")).logits[0], -1).numpy()
            np.testing.assert_allclose(one.outputs.probs, want, atol=1e-4)
            assert one.prompt_token_ids == tok("w3 w4 w5")["input_ids"]
        del llm


@pytest.mark.parametrize("tie", [False, True])
def test_causal_lm_reranker_from_tokens(tiny_models, tie):
    """A causal LM as a classifier from its lm_head rows (vLLM's --hf-overrides
    classifier_from_token, Qwen3-Reranker's recipe): from_2_way_softmax scores equal
    HF's softmax over the two tokens' logits at the last token (P(true)), the ranking
    HF's; no_post_processing classifies with the rows themselves (the raw logits)."""
    path = tiny_models("qwen3", tie=tie)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    false_id, true_id = tok.convert_tokens_to_ids(["w7", "w9"])
    rng = np.random.default_rng(11)
    query = " ".join(f"w{i}" for i in rng.integers(3, 500, 5))
    docs = [" ".join(f"w{i}" for i in rng.integers(3, 500, n)) for n in (3, 8, 20, 45)]
    with torch.no_grad():
        last = [hf(torch.tensor([tok(query, text_pair=d)["input_ids"]])).logits[0, -1] for d in docs]
    want = [float(torch.softmax(lg[[false_id, true_id]], 0)[1]) for lg in last]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w7", "w9"],
                 "method": "from_2_way_softmax"}
    llm = make_llm(path, hf_overrides=overrides)
    assert llm.config.model_config.pooler_config.num_labels == 1
    got = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.argsort(got).tolist() == np.argsort(want).tolist()
    del llm

    ids = prompts(6, [4, 37])
    with torch.no_grad():
        logits = [hf(torch.tensor([x])).logits[0, -1, [5, 7, 11]].numpy() for x in ids]
    rows = make_llm(path, hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                        "classifier_from_token": ["w5", "w7", "w11"]})
    rewards = rows.reward([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    np.testing.assert_allclose(np.stack([r.outputs.data for r in rewards]), np.stack(logits), atol=1e-4)
    assert rows.classify({"prompt_token_ids": ids[0]}, use_tqdm=False)[0].outputs.num_classes == 3


def test_hf_overrides_errors(tiny_models):
    path = tiny_models("qwen3")
    cls = ["Qwen3ForSequenceClassification"]
    with pytest.raises(ValueError, match="not single tokens"):  # the word vocabulary has no "yes" / "no"
        make_llm(path, hf_overrides={"architectures": cls, "is_original_qwen3_reranker": True})
    with pytest.raises(ValueError, match="classifier_from_token needs architectures"):
        make_llm(path, hf_overrides={"classifier_from_token": ["w3", "w4"]})
    with pytest.raises(ValueError, match="two classifier_from_token"):
        make_llm(path, hf_overrides={"architectures": cls, "classifier_from_token": ["w3"],
                                     "method": "from_2_way_softmax"})
    with pytest.raises(ValueError, match="method must be one of"):
        make_llm(path, hf_overrides={"architectures": cls, "classifier_from_token": ["w3"], "method": "x"})
    # A plain override reaches the model's config: a shorter position limit is enforced.
    with pytest.raises(ValueError, match="exceeds the model's limit of 64"):
        make_llm(path, hf_overrides={"max_position_embeddings": 64})
