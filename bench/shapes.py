"""Model shapes the GPU benchmarks build with local.tiny_model (random weights, made locally: no
model hub), as tiny_model's arguments."""

# Qwen2.5-0.5B: 896 hidden, 24 layers, 14 heads, 2 KV heads, 4864 intermediate, 151,936
# vocabulary; tiny_model ties the embeddings, as Qwen2.5-0.5B does
QWEN25_05B = dict(
    hidden_size=896,
    num_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
)
