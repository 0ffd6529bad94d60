"""The generated blocks of README.md and the manual (docs/), one module per results area: each function returns
one block's Markdown from bench/results/*.json. scripts/readme_tables.py writes them into the pages."""
