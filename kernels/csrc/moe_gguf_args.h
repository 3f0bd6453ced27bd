/* The int64 argument record of kvpilot_moe_gguf_packed (moe_cpu.c), which decode_layers_cpu.c fills too: the
 * rows, the routing, each projection's GGUF blocks (type, address, bytes per expert, bytes per row), the output.
 * kernels/gguf_moe.py writes the same order (and checks the count, kvpilot_moe_gguf_args). */
#ifndef KVPILOT_MOE_GGUF_ARGS_H
#define KVPILOT_MOE_GGUF_ARGS_H

enum {
    MG_X, MG_XS, MG_T, MG_H, MG_I, MG_E, MG_TOPK, MG_IDS, MG_WEIGHTS,
    MG_GATE_TYPE, MG_GATE, MG_GATE_ES, MG_GATE_RS, MG_UP_TYPE, MG_UP, MG_UP_ES, MG_UP_RS,
    MG_DOWN_TYPE, MG_DOWN, MG_DOWN_ES, MG_DOWN_RS, MG_BF16, MG_OUT, MG_OS, MG_THREADS, MG_ARGS
};

#endif
