"""Fine-tuning from a pretrained base: ``policy.path`` (config + weights + processors) and PEFT adapters.

- :mod:`.base` finds and loads the base policy a ``pretrained_model/`` directory holds.
- :mod:`.lora` wraps it in a ``peft`` model (LoRA), checks the ``peft.*`` group against the policy's module
  names, and maps the trainable parameters to the keys of ``adapter_model.safetensors``.

``peft`` (and the transformers import it pulls in, several seconds) is imported only by runs that use it.
"""
