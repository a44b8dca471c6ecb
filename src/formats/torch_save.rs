//! torch.save archives (`pytorch_model.bin`, `*.pt`, and each tensor item inside a `.distcp`):
//! `data.pkl` read as data only, tensors located as byte ranges of `data/N` records.
