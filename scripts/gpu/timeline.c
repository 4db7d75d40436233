// A CUPTI injection library (CUDA_INJECTION64_PATH) for scripts/gpu-timeline.sh: records the
// GPU start and end of every kernel a process runs, kernels inside CUDA graphs included (each
// graph node as its own record), and writes one line per kernel to $TIMELINE_OUT (default
// timeline.txt) when the process exits:
//   start_ns end_ns graph_id graph_node_id stream_id grid_x*y*z block_x name
// TIMELINE_ALL=1 keeps kernels outside graphs too (by default only graph nodes: the decode
// steps); TIMELINE_MAX caps the records kept (default 2,000,000). Built on the GPU machine
// against its toolkit's CUPTI (CUDA 13: CUpti_ActivityKernel10), scripts/gpu/timeline.py reads
// the file.
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define TIMELINE_BUF (8u << 20)

static FILE *out;
static int keep_all;
static long left = 2000000;

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
  *buf = (uint8_t *)aligned_alloc(8, TIMELINE_BUF);
  *size = *buf ? TIMELINE_BUF : 0;
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *r = NULL;
  while (out && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
    if ((!keep_all && k->graphId == 0) || left <= 0) continue;
    left--;
    fprintf(out, "%llu %llu %u %llu %u %lld %d %s\n", (unsigned long long)k->start, (unsigned long long)k->end,
            k->graphId, (unsigned long long)k->graphNodeId, k->streamId,
            (long long)k->gridX * k->gridY * k->gridZ, k->blockX, k->name ? k->name : "?");
  }
  free(buf);
}

static void finish(void) {
  cuptiActivityFlushAll(1);
  if (out) fclose(out);
  out = NULL;
}

int InitializeInjection(void) {
  const char *path = getenv("TIMELINE_OUT");
  const char *all = getenv("TIMELINE_ALL");
  const char *max = getenv("TIMELINE_MAX");
  keep_all = all && all[0] == '1';
  if (max) left = atol(max);
  out = fopen(path ? path : "timeline.txt", "w");
  if (!out) return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    fprintf(stderr, "timeline: CUPTI activity tracing could not start\n");
    return 0;
  }
  atexit(finish);
  return 1;
}
