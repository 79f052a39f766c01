"""The chat template the adapter applies for passthrough models, which take raw text.

Step-protocol models apply their own template; engines behind the vLLM or TensorRT-LLM
interface receive `text_input` as is, so the adapter turns a chat into text here.
"""

from __future__ import annotations

from sluice_inference_adapter.step_rows import PromptSpec


def chatml(prompt: PromptSpec) -> str:
    """ChatML, the template of SmolLM2, Qwen and many instruction-tuned models."""
    if not prompt.messages:
        return prompt.prompt
    turns = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in prompt.messages)
    return turns + "<|im_start|>assistant\n"
