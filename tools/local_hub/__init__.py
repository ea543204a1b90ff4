"""A local Hugging Face Hub for tests and demos (buckets, Xet CAS, Spaces)."""
