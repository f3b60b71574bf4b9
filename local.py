"""Running the project on one machine: a server process (`launch_server`, `stop_server`) and the
built-in tiny model (`tiny_model`: a seeded Qwen2 of a chosen shape with a character-level
tokenizer; nothing is downloaded), for the demo, the tests and the benchmarks; and `save_model`,
which replaces a model folder in one rename. Off the reading path: client.py is the client.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import requests
import torch

from client import DTYPES, Client, free_port


def launch_server(
    *flags, log_path=None, timeout=300.0, port=None, group_port=None, api_key=None, env=None
):
    """Start `python server.py *flags` (on free ports unless given; in environment `env`), its
    output going to `log_path` (default: a file in the temporary folder, named by the port); return
    (process, Client) once it is up. If it exits first, the error ends with its log's last lines."""
    port, group_port = port or free_port(), group_port or free_port()
    log_path = log_path or os.path.join(tempfile.gettempdir(), f"async-grpo-server-{port}.log")
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")
    command = [sys.executable, server, "--port", str(port), "--group-port", str(group_port), *flags]
    with open(log_path, "w") as log:
        key = ["--api-key", api_key] if api_key else []
        proc = subprocess.Popen(command + key, stdout=log, stderr=subprocess.STDOUT, env=env)
    client = Client(f"http://127.0.0.1:{port}", api_key=api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the engine takes ~25 s to start on CPU
        if proc.poll() is not None:
            with open(log_path) as log:
                tail = "".join(log.readlines()[-10:])
            raise RuntimeError(f"server exited with code {proc.returncode} ({log_path}):\n{tail}")
        try:
            client.health(timeout=2)
            return proc, client
        # not listening yet, or too busy starting to answer within 2 s
        except (ConnectionError, requests.Timeout):
            time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"server did not start within {timeout} s; see {log_path}")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the built-in tiny model: tests and the demo build it (nothing is downloaded; no vLLM needed) --
TINY_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache", "tiny-qwen2")


def qwen25(hidden, layers, heads, intermediate):
    """tiny_model's arguments for a shape of Qwen2.5's: 2 KV heads, its vocabulary (the embeddings
    tied, as there), and Qwen2's initialisation scale, at which bfloat16 rounding moves logprobs by
    ~0.01, not ~1."""
    return dict(
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        intermediate_size=intermediate,
        vocab_size=151936,
        initializer_range=0.02,
    )


# tiny_model's shapes: its own (2 layers of 128) and Qwen2.5's
SHAPES = {"tiny": {}, "0.5b": qwen25(896, 24, 14, 4864), "1.5b": qwen25(1536, 28, 12, 8960)}


def tiny_model(
    path=TINY_MODEL_DIR, seed=0, hidden_size=128, num_layers=2, dtype="float32", **overrides
):
    """Build (once) a small Qwen2 causal LM with a character-level tokenizer; return its folder. The
    same seed and sizes give the same weights; `overrides` are Qwen2Config fields (for
    benchmarks). Every token but end-of-text is a character, so any text the model writes is
    tokenised back into the very tokens it sampled (an OpenAI session merges)."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # end-of-text, tab, space, printable ASCII, newline; named as byte-level BPE names them (tab
    # "ĉ", space "Ġ", newline "Ċ"), since transformers loads a Qwen2 tokenizer as byte-level
    tokens = ["<|endoftext|>", "\u0109", "\u0120"] + [chr(i) for i in range(33, 127)] + ["\u010a"]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # padding is masked: any id will do
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.1,  # wide logits: no near-ties in greedy
        bos_token_id=0,
        eos_token_id=0,
        # the embedding's padding_idx, whose row starts at zero: the tab's (it was a pad token once)
        pad_token_id=1,
        torch_dtype=dtype,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    save_model(Qwen2ForCausalLM(config).to(DTYPES[dtype]), tokenizer, path)
    return path


def save_model(model, tokenizer, path, extra=None, state_dict=None):
    """save_pretrained into a new folder beside `path`, then make `path` (a symbolic link) point at
    it in one rename, and remove the folder it pointed at before: whenever the process dies,
    `path` holds the old model or the new one, whole. `extra`: {file name: object} saved beside it
    with torch.save; `state_dict`: the weights to save, if not the model's own."""
    folder = f"{path}.{time.time_ns()}"
    link = f"{folder}.link"
    old = None
    try:
        model.save_pretrained(folder, state_dict=state_dict)
        tokenizer.save_pretrained(folder)
        for name, obj in (extra or {}).items():
            torch.save(obj, os.path.join(folder, name))
        os.symlink(os.path.basename(folder), link)
        old = os.path.realpath(path) if os.path.islink(path) else None
        if os.path.isdir(path) and not old:
            # a plain folder (a checkpoint saved before the swap by a link): moved aside first
            old = f"{folder}.old"
            os.rename(path, old)
        # rename(2) replaces the link atomically
        os.replace(link, path)
    except BaseException:
        # stopped (Ctrl-C too) before the swap: `path` is as it was, and nothing is left beside it
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.lexists(link):
            os.remove(link)
        if old and not os.path.lexists(path):
            os.rename(old, path)
        raise
    if old:
        shutil.rmtree(old, ignore_errors=True)
