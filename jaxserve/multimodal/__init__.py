"""Host side of multimodal inputs (no jax): media loading, the checkpoint's HF image
processor, placeholder expansion, image hashes and Qwen's multimodal rotary positions."""
