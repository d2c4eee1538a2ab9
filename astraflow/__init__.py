"""AstraFlow: asynchronous, multi-policy RL of agentic LLMs on a log (Kafka) and an object store (S3)."""

__version__ = "0.1.0"
