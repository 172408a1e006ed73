/* A GPU timeline of one process, for a machine without Nsight Systems: CUDA loads this
 * library into every process that has CUDA_INJECTION64_PATH set to it (the driver calls
 * InitializeInjection), and CUPTI's activity API then records every kernel (graph
 * kernels and NCCL's included), copy and set, every host wait on the device
 * (synchronisation), and every runtime or driver call that took 50 us or more. Times are
 * CLOCK_MONOTONIC nanoseconds, the clock of `time.perf_counter_ns()`, so the records line
 * up with MLX_RELAY_TIMELINE's marks. One file per process,
 * $CUPTI_TRACE_DIR/rank<MLX_RANK>-<pid>.tsv, one tab-separated record a line:
 *     K start end stream graph name        a kernel
 *     C start end stream bytes copykind    a copy (M: a set)
 *     S start end stream type              the host waited (type: CUPTI's sync type)
 *     A start end tid name                 a runtime (R) or driver (D) call >= 50 us
 * Build (bench/gpu/prepare.sh does, here; carried to the device in .gpu/b):
 *     gcc -O2 -shared -fPIC -I/usr/local/cuda-13.0/include bench/gpu/cupti_trace.c \
 *       -L/usr/local/cuda-13.0/lib64 -lcupti -lpthread \
 *       -Wl,-rpath,/usr/local/cuda-13.0/targets/x86_64-linux/lib -o .gpu/b/cupti_trace.so
 * bench/gpu/trace_report.py reads the files beside the ranks' timelines.
 */
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BUFFER_BYTES (8u << 20)
#define SLOW_CALL_NS 50000u

static FILE *out;
static pthread_mutex_t writing = PTHREAD_MUTEX_INITIALIZER;

static uint64_t monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void CUPTIAPI give_buffer(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(8, BUFFER_BYTES);
  *size = *buffer ? BUFFER_BYTES : 0;
  *max_records = 0;
}

static void write_call(const CUpti_ActivityAPI *a, CUpti_CallbackDomain domain, char tag) {
  if (a->end - a->start < SLOW_CALL_NS) return;
  const char *name = "?";
  cuptiGetCallbackName(domain, a->cbid, &name);
  fprintf(out, "A\t%lu\t%lu\t%u\t%c:%s\n", a->start, a->end, a->threadId, tag, name);
}

static void CUPTIAPI take_buffer(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                 size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *record = NULL;
  pthread_mutex_lock(&writing);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)record;
        fprintf(out, "K\t%lu\t%lu\t%u\t%u\t%.1000s\n", k->start, k->end, k->streamId, k->graphId,
                k->name ? k->name : "?");
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const CUpti_ActivityMemcpy6 *c = (const CUpti_ActivityMemcpy6 *)record;
        fprintf(out, "C\t%lu\t%lu\t%u\t%lu\t%u\n", c->start, c->end, c->streamId, c->bytes,
                c->copyKind);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)record;
        fprintf(out, "M\t%lu\t%lu\t%u\t%lu\t0\n", m->start, m->end, m->streamId, m->bytes);
        break;
      }
      case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
        const CUpti_ActivitySynchronization2 *s = (const CUpti_ActivitySynchronization2 *)record;
        fprintf(out, "S\t%lu\t%lu\t%u\t%u\n", s->start, s->end, s->streamId, (unsigned)s->type);
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
        write_call((const CUpti_ActivityAPI *)record, CUPTI_CB_DOMAIN_RUNTIME_API, 'R');
        break;
      case CUPTI_ACTIVITY_KIND_DRIVER:
        write_call((const CUpti_ActivityAPI *)record, CUPTI_CB_DOMAIN_DRIVER_API, 'D');
        break;
      default:
        break;
    }
  }
  fflush(out);
  pthread_mutex_unlock(&writing);
  free(buffer);
}

/* Rank processes may leave with os._exit (no atexit): flush what CUPTI holds every
 * 200 ms, so at most that much of the end is lost. */
static void *flush_often(void *arg) {
  (void)arg;
  for (;;) {
    usleep(200000);
    cuptiActivityFlushAll(0);
  }
  return NULL;
}

static void flush_at_exit(void) { cuptiActivityFlushAll(1); }

int InitializeInjection(void) {
  const char *dir = getenv("CUPTI_TRACE_DIR");
  const char *rank = getenv("MLX_RANK");
  char path[4096];
  snprintf(path, sizeof path, "%s/rank%s-%d.tsv", dir ? dir : "/tmp", rank ? rank : "x",
           (int)getpid());
  out = fopen(path, "w");
  if (!out) return 0;
  cuptiActivityRegisterTimestampCallback(monotonic_ns);
  cuptiActivityRegisterCallbacks(give_buffer, take_buffer);
  CUpti_ActivityKind kinds[] = {
      CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
      CUPTI_ACTIVITY_KIND_MEMSET,            CUPTI_ACTIVITY_KIND_SYNCHRONIZATION,
      CUPTI_ACTIVITY_KIND_RUNTIME,           CUPTI_ACTIVITY_KIND_DRIVER,
  };
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    if (cuptiActivityEnable(kinds[i]) != CUPTI_SUCCESS)
      fprintf(stderr, "cupti_trace: activity kind %d not enabled\n", (int)kinds[i]);
  }
  atexit(flush_at_exit);
  pthread_t t;
  pthread_create(&t, NULL, flush_often, NULL);
  pthread_detach(t);
  return 1;
}
