"""Optional backends that plug into AstraFlow's contracts: ``connectors.vllm`` (an inference ``Engine``) and
``connectors.megatron`` (a ``TrainerBackend``)."""
