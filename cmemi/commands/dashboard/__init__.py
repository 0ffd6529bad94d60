"""`cmemi dashboard RUN_DIR`: a live page of a run in the browser, served by a small HTTP server with no dependency
beyond the standard library and no build step (the page, its script and its style are the files in `static/`,
served from here: the machine running it may be offline). One module per job:

- `cli`: the command line: bind, print the URL, serve until Ctrl-C; a bad address is one line, exit 2.
- `server`: the HTTP server and its routes (the page, its static files, the JSON endpoints the page polls).
- `static/`: the page (`index.html`), its script (`app.js`: the poll, the tables, the timeline; `curves.js`: the
  curves as inline SVG) and its style (`style.css`).
- `access`: who may read it: loopback only by default; bound elsewhere, a token in the URL, compared in constant time.
- `snapshot`: what the endpoints answer: `cmemi status`'s report (its own code, called), the curves and the events
  timeline (read incrementally by `tail`), the checkpoints on disk.
- `tail`: a JSON-lines file read from the last offset on each call, never again from the start.
"""
