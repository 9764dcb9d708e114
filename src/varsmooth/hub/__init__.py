"""Sharing on the Hub: what is uploaded, and the model card."""

from .card import MODEL_CARD_TEMPLATE, build_model_card

#: files of output_dir that `push_to_hub` uploads; nothing else (no optimizer, logs or training state)
SHAREABLE_PATTERNS = [
    "README.md", "config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
    "model.safetensors.index.json", "posterior.safetensors", "label_noise.parquet", "label_noise_summary.json",
    "noise_report.json", "*.png", "preprocessor_config.json", "processor_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
    "sentencepiece.bpe.model", "spiece.model", "added_tokens.json", "chat_template.jinja",
]

__all__ = ["MODEL_CARD_TEMPLATE", "SHAREABLE_PATTERNS", "build_model_card"]
