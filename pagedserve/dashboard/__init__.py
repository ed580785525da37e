"""The KV page-map dashboard: one static page (static/), fed live by `pagedserve serve`
(entrypoints/openai/dashboard.py) or by a simulator replay (`pagedserve sim --dashboard`)."""
