//! safetensors files: header parsing (bounded, checked) and header writing.
