"""TRL's VLLMClient habits on Client, against the session server: construction from host and
port, check_server, chat, update_named_param, reset_prefix_cache and generate's TRL shape.

Run: .venv/bin/python -m pytest tests/test_trl.py
"""

import urllib.parse

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client import Client, free_port, trl_output


def test_a_client_made_from_host_and_server_port_reaches_the_server(server):
    port = urllib.parse.urlsplit(server.base_url).port
    assert Client(host="127.0.0.1", server_port=port).health()["status"] == "ok"


def test_check_server_returns_the_health_of_a_server_that_is_up(server):
    assert server.check_server(total_timeout=5)["status"] == "ok"


def test_check_server_raises_a_connection_error_once_its_timeout_passes():
    with pytest.raises(ConnectionError, match="after 0.5 s"):
        Client(server_port=free_port()).check_server(total_timeout=0.5, retry_interval=0.1)


def test_chat_renders_the_messages_with_the_models_chat_template(server, model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "user", "content": "2+2?"}]
    [[c]] = server.chat([messages], max_tokens=2)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert c.prompt_token_ids == tok.encode(text, add_special_tokens=False)


def test_trl_output_is_generates_completions_in_trls_shape(server):
    results = server.generate(["ab", "cd"], n=2, max_tokens=3)
    out = trl_output(results)
    assert out["prompt_ids"] == [results[0][0].prompt_token_ids, results[1][0].prompt_token_ids]
    completions = [c for per_prompt in results for c in per_prompt]
    assert out["completion_ids"] == [c.token_ids for c in completions]
    assert out["logprobs"][3] == [[lp] for lp in completions[3].logprobs]
    assert out["logprob_token_ids"][3] == [[t] for t in completions[3].token_ids]


def test_update_named_param_pushes_one_tensor_as_a_new_version(server, model_path, restore_weights):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompt = server.generate(["1+2="], max_tokens=1)[0][0].prompt_token_ids
    server.init_communicator()
    try:
        v1 = server.update_model_params(model)
        # a new tensor, not the model's own: only update_named_param sends it
        norm = -3.0 * model.model.norm.weight.detach()
        v2 = server.update_named_param("model.norm.weight", norm)
        [[c]] = server.generate([prompt], max_tokens=8, temperature=0.0)
    finally:
        server.close_communicator()
    model.model.norm.weight.data.copy_(norm)
    tokens = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert v2 == v1 + 1 and c.version == v2
    assert c.token_ids == tokens[0, len(prompt) :].tolist()


def test_reset_prefix_cache_empties_it_on_an_idle_server(server):
    assert server.reset_prefix_cache() is True
