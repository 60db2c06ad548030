"""The Qwen2.5 decoder's numbers, shared by the families built on it (Qwen2.5-VL, Qwen2.5-Omni's thinker).

Not a family (no ``family.py``): ``arch.py`` (torch-free) holds the decoder's parameter counts split by
TP, its number checks, typed blocks and parallel axes.
"""
