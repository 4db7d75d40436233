// llama.cpp's quantizer through its library API, for the GPU machine's comparisons
// (scripts/compare-llamacpp.sh): the vendored llama.cpp tree of ../shared/peers ships
// libllama but not the `llama-quantize` tool, and `llama_model_quantize` is what that tool
// calls. Usage: llama_quantize IN.gguf OUT.gguf TYPE (Q4_0, Q4_1, Q8_0, Q4_K_S, Q4_K_M,
// Q5_K_S, Q5_K_M, Q6_K). The mixes (which tensors get which type) are llama.cpp's own.
#include <stdio.h>
#include <string.h>

#include "llama.h"

static const struct {
    const char* name;
    enum llama_ftype ftype;
} TYPES[] = {
    {"Q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},     {"Q4_1", LLAMA_FTYPE_MOSTLY_Q4_1},
    {"Q8_0", LLAMA_FTYPE_MOSTLY_Q8_0},     {"Q4_K_S", LLAMA_FTYPE_MOSTLY_Q4_K_S},
    {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M}, {"Q5_K_S", LLAMA_FTYPE_MOSTLY_Q5_K_S},
    {"Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M}, {"Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K},
};

int main(int argc, char** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s IN.gguf OUT.gguf TYPE\n", argv[0]);
        return 2;
    }
    struct llama_model_quantize_params params = llama_model_quantize_default_params();
    int found = 0;
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++) {
        if (strcmp(argv[3], TYPES[i].name) == 0) {
            params.ftype = TYPES[i].ftype;
            found = 1;
        }
    }
    if (!found) {
        fprintf(stderr, "error: unknown quantization type '%s'\n", argv[3]);
        return 2;
    }
    llama_backend_init();
    unsigned rc = llama_model_quantize(argv[1], argv[2], &params);
    llama_backend_free();
    if (rc != 0) {
        fprintf(stderr, "error: llama_model_quantize failed (%u)\n", rc);
        return 1;
    }
    return 0;
}
