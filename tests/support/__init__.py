"""Test support code: test-only tiny processors of the non-Qwen families."""
