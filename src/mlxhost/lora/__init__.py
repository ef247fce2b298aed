"""LoRA adapters served on their base model: many fine-tunes in one batch (docs/lora.md)."""
