"""Gradient compression: a worker's gradients encoded for the wire and decoded, as hostile input, on the servers.

- base        the codec contract (info and frames, CodecError, GradientCodec) and the encode/decode driver
- registry    make_codec: the codec a config names, and the list of codecs
- dense       none (fp32 as it is, or one flat frame) and fp16/bf16 (a cast)
- int8        per-chunk absmax int8
- lowbit      int4 and int2: per-chunk absmax, packed codes (outer changes in a few bits)
- sparse2     per-chunk top-k at 2 bits, and the per-replica error feedback of local steps
- feedback    error feedback: the residual state topk, powersgd and sign keep per worker
- topk        the k largest magnitudes, and their selection independent of torch.topk's order
- powersgd    rank-r P @ Q^T, one warm-started power iteration
- sign        1 bit per element and a scale per chunk
- sizes       wire bytes and compression ratios
- downlink    parameters sent to workers as compressed changes of a mirror every worker holds
"""
