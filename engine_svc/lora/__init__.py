"""Multi-LoRA serving: PEFT adapters on the base model, chosen per request, mixed in one batch.

- `modules.py`: the `--lora-modules name=path` arguments and their bounds (torch-free);
- `peft_dir.py`: reads and validates one PEFT adapter directory;
- `slots.py`: the device-side slot buffers of one linear layer and the batched shrink/expand that adds
  each token's adapter delta to the layer's output;
- `manager.py`: attaches slots to a model, keeps every loaded adapter on the host, and swaps adapters
  into the fixed device slots as a step needs them;
- `registry.py`: the engine's adapters by name as they change at run time (load / unload), sent to the
  workers with the steps.
"""
