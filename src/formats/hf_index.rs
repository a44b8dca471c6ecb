//! Hugging Face split checkpoints: `model.safetensors.index.json` + `model-0000i-of-0000n.safetensors`.
