"""Made-up host rates for the plan's time tests: nothing measured, every field set."""


def fake_rates(**kw):
    """HostRates with round made-up rates (every field); kw overrides any of them."""
    from fasttrain.plan.host_rates import HostRates
    base = dict(device="a test CPU (2 cores)", threads=1, matmul_bf16=4e11, matmul_fp32=1e11, bandwidth=3e10,
                attention_fwd_bf16=8e10, attention_fb_bf16=8e10, attention_fwd_fp32=8e10, attention_fb_fp32=8e10,
                decode_rows16_bf16=2e11, decode_rows64_bf16=3e11, decode_attention_bf16=2e10,
                decode_rows16_fp32=6e10, decode_rows64_fp32=8e10, decode_attention_fp32=2e10,
                elementwise_bf16=5e9, elementwise_fp32=8e9, sampling=6e7, decode_layer=1e-4, decode_call=1e-4,
                forward_layer=5e-4, forward_call=5e-4, train_layer=2e-3, train_call=1e-3, train_ckpt_layer=3e-3,
                train_ckpt_call=1e-3, moe_fwd_nf4=3e10, moe_fb_nf4=2e10, moe_decode_nf4=4e9, moe_fwd_16=5e10,
                moe_fb_16=3e10, moe_decode_16=8e9, measured_at="2026-01-02 03:04 UTC")
    return HostRates(**{**base, **kw})
