// The device loop of a TreeGraph's programs (rltlab/engine/device_loop.py): one CUDA graph
// that runs a request's tree programs after the first, each chosen and started on the device,
// so the host neither launches them nor waits between them. Built at first use with nvcc
// (-cudart shared: the CUDA runtime torch has loaded); needs CUDA >= 12.8 (IF / ELSE nodes).
// Every function returns a cudaError_t (0: success).
#include <cuda_runtime.h>

// A conditional node's value from a flag in device memory (written by the decide graph).
__global__ void set_condition(cudaGraphConditionalHandle handle, const int* flag) {
  cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}

static cudaError_t add_setter(cudaGraphNode_t* node, cudaGraph_t graph, cudaGraphNode_t after,
                              cudaGraphConditionalHandle* handle, const int** flag) {
  void* args[] = {handle, flag};
  cudaKernelNodeParams params = {};
  params.func = (void*)set_condition;
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

extern "C" {

// decide -> set(go) -> WHILE(go) { set(rows) -> IF(rows) with_rows ELSE without_rows ->
// decide -> set(go) }: with_rows / without_rows are the programs with and without the lookup
// chain's rows, decide a graph that reads the last program's output and writes
// flags = [go on, the next program's rows]. The bodies are cloned into the loop.
int build_tree_loop(void* with_rows, void* without_rows, void* decide, const int* flags,
                    void** exec_out) {
  cudaGraph_t outer = nullptr, loop_body, branches[2];
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
  if (outer) cudaGraphDestroy(outer);   // the executable graph holds its own copy
  return err;
}

int launch(void* exec, void* stream) {
  return cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream);
}

const char* error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}
