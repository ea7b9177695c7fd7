"""Generate text with the small default model: plain prompts, then a chat turn."""
from hetero import LLM, SamplingParams

llm = LLM(model="SmolLM2-135M-Instruct", max_model_len=2048)
prompts = ["Hello, my name is", "The capital of France is"]
outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0))
for output in outputs:
    print(f"{output.prompt!r} -> {output.outputs[0].text!r}")

reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32))
print("chat:", reply[0].outputs[0].text)
