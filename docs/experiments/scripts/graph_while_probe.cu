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

int launch(void* exec, void* stream) {
  return cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream);
}

const char* error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}
