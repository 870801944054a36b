// What a cold first pass that leaves the shards resident can reach: one thread per shard reads it in
// 4 MiB reads (QD 1) into each kind of memory (docs/benchmarks.md, 2026-12-02, set 3).
//
//   gcc -O2 -pthread -o /tmp/first_pass_memory bench/scripts/first_pass_memory.c
//   M=$(bash bench/scripts/loop_rig.sh up 4 2)   # then shards on the mounts, and per mode:
//   sync; echo 3 > /proc/sys/vm/drop_caches; /tmp/first_pass_memory MODE SHARD...
//
// Prints GB/s over the reads (mode 3: over the copies), and the seconds spent mapping/faulting the
// memory before them.
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#define BS (4u << 20)
static int mode; static char **paths; static char **arenas; static size_t *sizes;
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void *run(void *a){
  long i=(long)a; void *buf=NULL; if(posix_memalign(&buf,4096,BS)){perror("posix_memalign");exit(1);}
  int fd=open(paths[i],O_RDONLY|(mode==4?0:O_DIRECT)); if(fd<0){perror("open");exit(1);}
  size_t sz=sizes[i];
  for(size_t off=0;off<sz;off+=BS){
    size_t n = sz-off<BS? sz-off:BS;
    char *dst = (mode==2)? arenas[i]+off : buf;
    if(mode!=3){ ssize_t r=pread(fd,dst,n,off); if(r<=0){perror("pread");exit(1);} }
    if(mode==1) memcpy(arenas[i]+off,buf,n);
    if(mode==3) memcpy(buf,arenas[i]+off,n);
  }
  close(fd); free(buf); return 0;
}
int main(int argc,char**argv){
  // mode 0: O_DIRECT into a reused buffer; 1: + memcpy into a fresh arena; 2: O_DIRECT straight
  // into the fresh arena; 3: (after 2) memcpy arena -> reused buffer, no I/O; 4: buffered pread.
  // 5: like 1 with the arena faulted in first (MAP_POPULATE), the faulting timed apart.
  // 6: like 2, 7: like 1, with the arena advised MADV_HUGEPAGE (transparent huge pages).
  mode=atoi(argv[1]); int n=argc-2; paths=argv+2; int huge = mode>=6; int m = mode==5?1:mode==6?2:mode==7?1:mode;
  arenas=calloc(n,sizeof(char*)); sizes=calloc(n,sizeof(size_t));
  size_t tot=0; for(int i=0;i<n;i++){struct stat st; stat(paths[i],&st); sizes[i]=st.st_size; tot+=st.st_size;}
  double tf=now();
  for(int i=0;i<n;i++) if(m==1||m==2||m==3){ arenas[i]=mmap(0,sizes[i],PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS|(mode==5?MAP_POPULATE:0),-1,0); if(huge) madvise(arenas[i],sizes[i],MADV_HUGEPAGE); }
  tf=now()-tf;
  pthread_t t[256]; double t0=now();
  if(mode==3){ mode=2; for(long i=0;i<n;i++) pthread_create(&t[i],0,run,(void*)i); for(int i=0;i<n;i++) pthread_join(t[i],0);
    mode=3; t0=now(); /* copies only */
    for(long i=0;i<n;i++) pthread_create(&t[i],0,run,(void*)i); }
  else { mode=m; for(long i=0;i<n;i++) pthread_create(&t[i],0,run,(void*)i); }
  for(int i=0;i<n;i++) pthread_join(t[i],0);
  double dt=now()-t0;
  printf("%.2f GB/s (%.3f s; mapping/faulting %.3f s)\n", tot/dt/1e9, dt, tf);
  return 0;
}
