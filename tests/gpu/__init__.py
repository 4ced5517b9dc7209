"""Tests that need a CUDA GPU (marked `gpu`); each module skips itself when CUDA is unavailable."""
