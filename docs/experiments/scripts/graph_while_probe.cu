// A CUDA graph WHILE node around a body graph captured by torch (graph_while_probe.py): the
// body runs, then keep_going() sets the loop's condition from device memory, so the host
// launches once for any number of iterations. Built by the probe with nvcc (-cudart shared:
// the runtime torch already loaded). Every function returns a cudaError_t (0: success).
#include <cuda_runtime.h>

__global__ void keep_going(cudaGraphConditionalHandle handle, const long long* counter,
                           const long long* limit) {
  cudaGraphSetConditional(handle, *counter < *limit ? 1u : 0u);
}

extern "C" {

// outer graph = WHILE(handle, first pass always) { child(bodies[0]) -> ... ->
// child(bodies[count - 1]) -> keep_going(counter, limit) }, instantiated into *exec_out.
int build_while(void** bodies, int count, const long long* counter, const long long* limit,
                void** exec_out) {
  cudaGraph_t outer;
  cudaError_t err = cudaGraphCreate(&outer, 0);
  if (err) return err;
  cudaGraphConditionalHandle handle;
  err = cudaGraphConditionalHandleCreate(&handle, outer, 1, cudaGraphCondAssignDefault);
  if (err) return err;
  cudaGraphNodeParams loop_params = {};
  loop_params.type = cudaGraphNodeTypeConditional;
  loop_params.conditional.handle = handle;
  loop_params.conditional.type = cudaGraphCondTypeWhile;
  loop_params.conditional.size = 1;
  cudaGraphNode_t loop;
#if CUDART_VERSION >= 13000
  err = cudaGraphAddNode(&loop, outer, nullptr, nullptr, 0, &loop_params);
#else
  err = cudaGraphAddNode(&loop, outer, nullptr, 0, &loop_params);
#endif
  if (err) return err;
  cudaGraph_t inner = loop_params.conditional.phGraph_out[0];
  cudaGraphNode_t child = nullptr;
  for (int i = 0; i < count; ++i) {
    cudaGraphNode_t last = child;
    err = cudaGraphAddChildGraphNode(&child, inner, last ? &last : nullptr, last ? 1 : 0,
                                     (cudaGraph_t)bodies[i]);
    if (err) return err;
  }
  void* args[] = {&handle, &counter, &limit};
  cudaKernelNodeParams setter_params = {};
  setter_params.func = (void*)keep_going;
  setter_params.gridDim = dim3(1);
  setter_params.blockDim = dim3(1);
  setter_params.kernelParams = args;
  cudaGraphNode_t setter;
  err = cudaGraphAddKernelNode(&setter, inner, &child, 1, &setter_params);
  if (err) return err;
  cudaGraphExec_t exec;
  err = cudaGraphInstantiate(&exec, outer, 0);
  if (err) return err;
  *exec_out = exec;
  return 0;
}

__global__ void set_flag(cudaGraphConditionalHandle handle, const int* flag) {
  cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}

static cudaError_t add_setter(cudaGraphNode_t* node, cudaGraph_t graph, cudaGraphNode_t after,
                              cudaGraphConditionalHandle* handle, const int** flag) {
  void* args[] = {handle, flag};
  cudaKernelNodeParams params = {};
  params.func = (void*)set_flag;
  params.gridDim = dim3(1);
  params.blockDim = dim3(1);
  params.kernelParams = args;
  return cudaGraphAddKernelNode(node, graph, after ? &after : nullptr, after ? 1 : 0, &params);
}

static cudaError_t add_conditional(cudaGraphNode_t* node, cudaGraph_t graph,
                                   cudaGraphNode_t after, cudaGraphConditionalHandle handle,
                                   cudaGraphConditionalNodeType type, unsigned size,
                                   cudaGraph_t* bodies) {
  cudaGraphNodeParams params = {};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = type;
  params.conditional.size = size;
#if CUDART_VERSION >= 13000
  cudaError_t err = cudaGraphAddNode(node, graph, after ? &after : nullptr, nullptr,
                                     after ? 1 : 0, &params);
#else
  cudaError_t err = cudaGraphAddNode(node, graph, after ? &after : nullptr, after ? 1 : 0,
                                     &params);
#endif
  for (unsigned i = 0; !err && i < size; ++i) bodies[i] = params.conditional.phGraph_out[i];
  return err;
}

// The tree programs' loop (device_loop_ab.py): in the outer graph, child(decide) ->
// set_flag(go, flags[0]) -> WHILE(go) { set_flag(rows, flags[1]) -> IF(rows) child(with_rows)
// ELSE child(without_rows) -> child(decide) -> set_flag(go, flags[0]) }. decide (a torch
// graph) reads the last program's output and writes flags = [go on, next program's rows].
int build_tree_loop(void* with_rows, void* without_rows, void* decide, const int* flags,
                    void** exec_out) {
  cudaGraph_t outer, loop_body, branches[2];
  cudaGraphConditionalHandle go, rows;
  cudaGraphNode_t first, set_go, loop, set_rows, choice, again, set_again, leaf;
  const int* rows_flag = flags + 1;
  cudaError_t err = cudaGraphCreate(&outer, 0);
  if (!err) err = cudaGraphConditionalHandleCreate(&go, outer, 0, cudaGraphCondAssignDefault);
  if (!err) err = cudaGraphAddChildGraphNode(&first, outer, nullptr, 0, (cudaGraph_t)decide);
  if (!err) err = add_setter(&set_go, outer, first, &go, &flags);
  if (!err) err = add_conditional(&loop, outer, set_go, go, cudaGraphCondTypeWhile, 1,
                                  &loop_body);
  if (!err) err = cudaGraphConditionalHandleCreate(&rows, loop_body, 0,
                                                   cudaGraphCondAssignDefault);
  if (!err) err = add_setter(&set_rows, loop_body, nullptr, &rows, &rows_flag);
  if (!err) err = add_conditional(&choice, loop_body, set_rows, rows, cudaGraphCondTypeIf, 2,
                                  branches);
  if (!err) err = cudaGraphAddChildGraphNode(&leaf, branches[0], nullptr, 0,
                                             (cudaGraph_t)with_rows);
  if (!err) err = cudaGraphAddChildGraphNode(&leaf, branches[1], nullptr, 0,
                                             (cudaGraph_t)without_rows);
  if (!err) err = cudaGraphAddChildGraphNode(&again, loop_body, &choice, 1,
                                             (cudaGraph_t)decide);
  if (!err) err = add_setter(&set_again, loop_body, again, &go, &flags);
  cudaGraphExec_t exec;
  if (!err) err = cudaGraphInstantiate(&exec, outer, 0);
  if (!err) *exec_out = exec;
  return err;
}

int launch(void* exec, void* stream) {
  return cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream);
}

const char* error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}
