"""Inference engines behind one protocol (`base.Engine`): the embedded transformers engine (`hf.HFEngine`) and
vLLM (`vllm.VLLMEngine`). Import each from its module; importing this package loads nothing."""
