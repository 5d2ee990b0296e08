// sdfarm: the graph walk our fusions share (applied by sdfarm.native.sourcepatch beside the
// patches that fuse: group_norm_split.cuh, conv2d_cudnn.cuh). Needs ggml-impl.h, which the
// CUDA sources have through common.cuh; the host tests define SDFARM_HOST_GRAPH and include
// ggml-impl.h themselves.
#pragma once

#include <cstdlib>

#if defined(__CUDACC__) || defined(SDFARM_HOST_GRAPH)
// The first character of an environment variable, or 0 where it is unset or empty: our
// patches' switches (each read once per process, into a static).
static char sdfarm_env_first(const char * name) {
    const char * v = getenv(name);
    return v != nullptr ? v[0] : '\0';
}

// Whether a graph node computes nothing (the graph loop of ggml-cuda.cu skips these too).
static bool sdfarm_computes_nothing(const ggml_tensor * t) {
    return ggml_is_empty(t) || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_TRANSPOSE ||
           t->op == GGML_OP_VIEW || t->op == GGML_OP_PERMUTE || t->op == GGML_OP_NONE;
}

// Whether node idx of the graph is read by exactly one node and nowhere else: ggml's own
// ggml_node_has_n_uses, except that it allows a node to be an in-place view of `base`
// (stable-diffusion.cpp's bias adds and activations are in place, so each is a view of the
// node it follows; any other view of that tensor is a use of one of them, and is counted).
static bool sdfarm_one_use(const ggml_cgraph * cgraph, int idx, const ggml_tensor * base) {
    const ggml_tensor * t = cgraph->nodes[idx];
    return ggml_node_get_use_count(cgraph, idx) == 1 &&
           (t->view_src == nullptr || t->view_src == base) && (t->flags & GGML_TENSOR_FLAG_OUTPUT) == 0;
}

// The index of the first node after j that computes something (j itself when it does), or
// n_nodes.
static int sdfarm_next_computing(const ggml_cgraph * cgraph, int j) {
    while (j < cgraph->n_nodes && sdfarm_computes_nothing(cgraph->nodes[j])) {
        j++;
    }
    return j;
}
#endif
