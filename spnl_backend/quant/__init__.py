"""GGML block formats, quantized linear layers and the ISQ plan."""
