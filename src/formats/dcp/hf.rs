//! DCP's Hugging Face flavour: per-rank safetensors files whose `__metadata__` holds
//! `DCP_SHARDING_INFO` (`{fqn: {"saved_offsets": [..]}}`). No global shape is stored.
