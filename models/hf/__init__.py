"""HF transformers checkpoint interop: config and name mapping, import into any layout, export."""
