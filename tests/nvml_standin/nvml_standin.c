/*
 * A stand-in for NVIDIA's libnvidia-ml.so.1 on machines with no GPU: the NVML calls the agent
 * makes through nvidia-ml-py (pynvml), answered for the stand-in GPUs a test machine lists.
 *
 * Types, constants and signatures follow NVIDIA's public "NVML API Reference Guide"
 * (docs.nvidia.com/deploy/nvml-api); every value was checked against the constants and ctypes
 * structures of nvidia-ml-py's pynvml module, which is what the agent sees. No NVIDIA header is
 * used.
 *
 * Everything is read below a root folder, $DENV_NVML_STANDIN_ROOT (default "/"):
 *   sys/bus/pci/devices/                    the GPUs: vendor 0x10de, class 0x0302xx (at init)
 *   var/lib/nvidia-standin/module-version   the loaded kernel module's version (at init): absent
 *                                           -> driver not loaded, another version -> mismatch
 *   var/lib/nvidia-standin/state.json       the stand-in nvidia-smi's MIG mode, current and pending
 *   run/nvidia-standin/mig.json             its MIG instances (in /run: gone at reboot, as real
 *                                           GPU instances are)
 *   run/nvidia-standin/nvidiactl            held open from init to the last shutdown, as NVML
 *                                           holds /dev/nvidiactl: the stand-in nvidia-smi refuses
 *                                           a GPU reset while any process holds it
 *   var/lib/nvidia-standin/nvml-faults      faults, re-read on every call, one per line:
 *       xid GPU XID        an XID event, delivered once to each event set created before the
 *                          line was written (append a line per event)
 *       lost GPU           device calls on GPU return NVML_ERROR_GPU_IS_LOST
 *       remap_pending GPU  nvmlDeviceGetRemappedRows says a remap is pending
 *       remap_failure GPU  ... and that one failed
 *       ecc GPU COUNT      volatile uncorrectable ECC errors
 *       temperature GPU C
 *       recovery GPU N     the GPU recovery action field (NVML_GPU_RECOVERY_ACTION_*)
 *       hang CALL          CALL (an exported name, or *) blocks until this line is gone
 *       error CALL CODE [GPU]  CALL (or *) returns the NVML error CODE
 * Remove a line to clear its fault.
 */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef STANDIN_DRIVER
#define STANDIN_DRIVER "580.95.05"
#endif

/* NVML's names and values (nvmlReturn_t and others); a test checks each against pynvml. */
typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18

#define NVML_MEMORY_ERROR_TYPE_UNCORRECTED 1   /* nvmlMemoryErrorType_t */
#define NVML_VALUE_TYPE_UNSIGNED_INT 1         /* nvmlValueType_t */
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230 /* a field id (recent drivers) */
#define nvmlEventTypeXidCriticalError 0x8ULL
#define STANDIN_EVENT_TYPES 0x1fULL /* ECC, P-state, XID and clock events */
#define STANDIN_MIG_SLOTS 7           /* nvmlDeviceGetMaxMigDeviceCount on H100 */
#define NO_INSTANCE 0xFFFFFFFFu            /* event data's GPU/compute instance: none */

#define MAX_GPUS 16
#define MAX_XIDS 256
#define MAX_RULES 32
#define NAME_LEN 64

typedef struct nvmlDevice_st {
    int gpu;
    int mig; /* -1: the whole GPU */
} *nvmlDevice_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

typedef struct nvmlEventSet_st {
    unsigned long long registered[MAX_GPUS];
    int delivered; /* xid lines already behind this set */
} *nvmlEventSet_t;

/* Machine facts, read at init. */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static int gpu_count;
static unsigned int gpu_bus[MAX_GPUS];
static struct nvmlDevice_st gpus[MAX_GPUS];
static struct nvmlDevice_st migs[MAX_GPUS][STANDIN_MIG_SLOTS];
static int device_fd = -1; /* the stand-in's /dev/nvidiactl, open while initialized */

struct faults {
    int lost[MAX_GPUS], remap_pending[MAX_GPUS], remap_failure[MAX_GPUS];
    int temperature[MAX_GPUS], recovery[MAX_GPUS];
    unsigned long long ecc[MAX_GPUS];
    int xids, xid_gpu[MAX_XIDS], xid_code[MAX_XIDS];
    int hangs, errors;
    char hang[MAX_RULES][NAME_LEN];
    char error_call[MAX_RULES][NAME_LEN];
    int error_code[MAX_RULES], error_gpu[MAX_RULES];
};

static void path_of(char *out, size_t size, const char *relative) {
    const char *root = getenv("DENV_NVML_STANDIN_ROOT");
    snprintf(out, size, "%s/%s", root && *root ? root : "", relative);
}

static int read_text(const char *relative, char *out, size_t size) {
    char path[4096];
    path_of(path, sizeof path, relative);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(out, 1, size - 1, f);
    fclose(f);
    out[n] = 0;
    out[strcspn(out, "\n")] = 0;
    return 1;
}

static int valid_gpu(int gpu) { return gpu >= 0 && gpu < gpu_count; }

static void read_faults(struct faults *f) {
    memset(f, 0, sizeof *f);
    for (int i = 0; i < MAX_GPUS; i++)
        f->temperature[i] = 34;
    char path[4096], line[256], word[NAME_LEN], call[NAME_LEN];
    path_of(path, sizeof path, "var/lib/nvidia-standin/nvml-faults");
    FILE *file = fopen(path, "r");
    if (!file)
        return;
    while (fgets(line, sizeof line, file)) {
        int a = -1, b = 0, c = -1;
        long long count = 0;
        if (sscanf(line, "%63s", word) != 1 || word[0] == '#')
            continue;
        if (!strcmp(word, "xid") && sscanf(line, "xid %d %d", &a, &b) == 2 && f->xids < MAX_XIDS) {
            f->xid_gpu[f->xids] = a;
            f->xid_code[f->xids++] = b;
        } else if (!strcmp(word, "hang") && sscanf(line, "hang %63s", call) == 1 &&
                   f->hangs < MAX_RULES) {
            strcpy(f->hang[f->hangs++], call);
        } else if (!strcmp(word, "error") && sscanf(line, "error %63s %d %d", call, &b, &c) >= 2 &&
                   f->errors < MAX_RULES) {
            strcpy(f->error_call[f->errors], call);
            f->error_code[f->errors] = b;
            f->error_gpu[f->errors++] = c;
        } else if (sscanf(line, "%*s %d %lld", &a, &count) >= 1 && a >= 0 && a < MAX_GPUS) {
            if (!strcmp(word, "lost"))
                f->lost[a] = 1;
            else if (!strcmp(word, "remap_pending"))
                f->remap_pending[a] = 1;
            else if (!strcmp(word, "remap_failure"))
                f->remap_failure[a] = 1;
            else if (!strcmp(word, "ecc"))
                f->ecc[a] = (unsigned long long)count;
            else if (!strcmp(word, "temperature"))
                f->temperature[a] = (int)count;
            else if (!strcmp(word, "recovery"))
                f->recovery[a] = (int)count;
        }
    }
    fclose(file);
}

static void pause_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int hangs(const struct faults *f, const char *call) {
    for (int i = 0; i < f->hangs; i++)
        if (!strcmp(f->hang[i], call) || !strcmp(f->hang[i], "*"))
            return 1;
    return 0;
}

/* What every call does first: wait out a hang, then the errors real NVML would return. */
static nvmlReturn_t enter(const char *call, int gpu, struct faults *f) {
    for (read_faults(f); hangs(f, call); read_faults(f))
        pause_ms(20);
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    for (int i = 0; i < f->errors; i++)
        if ((!strcmp(f->error_call[i], call) || !strcmp(f->error_call[i], "*")) &&
            (f->error_gpu[i] < 0 || f->error_gpu[i] == gpu))
            return f->error_code[i];
    if (gpu >= 0 && f->lost[gpu])
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

static int device_gpu(nvmlDevice_t device) {
    for (int i = 0; i < gpu_count; i++) {
        if (device == &gpus[i])
            return i;
        for (int m = 0; m < STANDIN_MIG_SLOTS; m++)
            if (device == &migs[i][m])
                return i;
    }
    return -1;
}

#define DEVICE_CALL(device)                                                                        \
    struct faults f;                                                                               \
    int gpu = device_gpu(device);                                                                  \
    nvmlReturn_t rc = enter(__func__, gpu, &f);                                                    \
    if (rc != NVML_SUCCESS)                                                                        \
        return rc;                                                                                 \
    if (gpu < 0)                                                                                   \
        return NVML_ERROR_INVALID_ARGUMENT;

/* Where GPU `gpu`'s value starts in the object `name` of `text` ({"name": {"0": VALUE}}), as
 * the stand-in nvidia-smi writes its JSON; NULL when the object has none for it. */
static char *gpu_value(char *text, const char *name, int gpu) {
    char head[32], key[32];
    snprintf(head, sizeof head, "\"%s\": {", name);
    snprintf(key, sizeof key, "\"%d\": ", gpu);
    char *object = strstr(text, head);
    char *found = object ? strstr(object, key) : NULL;
    return found && found < strchr(object, '}') ? found + strlen(key) : NULL;
}

/* The stand-in nvidia-smi's MIG state: whether MIG is on for `gpu` (state.json
 * {"mig": {"0": true}, "pending": {"0": false}}), whether it will be after a reset (`pending`,
 * may be NULL), and its instances' profile names (mig.json {"devices": {"0": ["1g.10gb"]}}). */
static int mig_state(int gpu, char profiles[][NAME_LEN], int *count, int *pending) {
    char text[16384]; /* per call: the pollers of several GPUs ask at once */
    *count = 0;
    int on = 0;
    if (read_text("var/lib/nvidia-standin/state.json", text, sizeof text)) {
        char *value = gpu_value(text, "mig", gpu);
        on = value && !strncmp(value, "true", 4);
        value = gpu_value(text, "pending", gpu);
        if (pending)
            *pending = value ? !strncmp(value, "true", 4) : on;
    } else if (pending) {
        *pending = 0;
    }
    char *p = on && read_text("run/nvidia-standin/mig.json", text, sizeof text)
                  ? gpu_value(text, "devices", gpu)
                  : NULL;
    char *close = p ? strchr(p, ']') : NULL;
    while (close && *count < STANDIN_MIG_SLOTS && (p = strchr(p, '"')) && p < close) {
        sscanf(p, "\"%63[^\"]\"", profiles[*count]);
        (*count)++;
        p = strchr(p + 1, '"') + 1;
    }
    return on;
}

static int is_gpu(const char *name) {
    char relative[512], vendor[64], class[64];
    snprintf(relative, sizeof relative, "sys/bus/pci/devices/%s/vendor", name);
    if (!read_text(relative, vendor, sizeof vendor) || strncmp(vendor, "0x10de", 6))
        return 0;
    snprintf(relative, sizeof relative, "sys/bus/pci/devices/%s/class", name);
    return read_text(relative, class, sizeof class) && !strncmp(class, "0x0302", 6);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    struct faults f;
    for (read_faults(&f); hangs(&f, __func__); read_faults(&f))
        pause_ms(20);
    char loaded[128], path[4096];
    if (!read_text("var/lib/nvidia-standin/module-version", loaded, sizeof loaded))
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (strcmp(loaded, STANDIN_DRIVER))
        return NVML_ERROR_LIB_RM_VERSION_MISMATCH;
    pthread_mutex_lock(&init_lock);
    if (init_count++ == 0) {
        struct dirent **names;
        path_of(path, sizeof path, "sys/bus/pci/devices");
        int n = scandir(path, &names, NULL, alphasort);
        gpu_count = 0;
        for (int i = 0; i < n; i++) {
            unsigned int domain, bus;
            if (gpu_count < MAX_GPUS && is_gpu(names[i]->d_name) &&
                sscanf(names[i]->d_name, "%x:%x", &domain, &bus) == 2)
                gpu_bus[gpu_count++] = bus;
            free(names[i]);
        }
        if (n >= 0)
            free(names);
        /* -1 where the folder is missing (a machine without the stand-in driver's /run). */
        path_of(path, sizeof path, "run/nvidia-standin/nvidiactl");
        device_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        for (int i = 0; i < MAX_GPUS; i++) {
            gpus[i] = (struct nvmlDevice_st){i, -1};
            for (int m = 0; m < STANDIN_MIG_SLOTS; m++)
                migs[i][m] = (struct nvmlDevice_st){i, m};
        }
    }
    pthread_mutex_unlock(&init_lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&init_lock);
    nvmlReturn_t rc = init_count ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (init_count && --init_count == 0 && device_fd >= 0) {
        close(device_fd);
        device_fd = -1;
    }
    pthread_mutex_unlock(&init_lock);
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    return result == NVML_SUCCESS ? "Success" : "Stand-in NVML error";
}

static nvmlReturn_t copy_text(const char *text, char *out, unsigned int size) {
    if (strlen(text) >= size)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    struct faults f;
    nvmlReturn_t rc = enter(__func__, -1, &f);
    return rc != NVML_SUCCESS ? rc : copy_text(STANDIN_DRIVER, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    struct faults f;
    nvmlReturn_t rc = enter(__func__, -1, &f);
    return rc != NVML_SUCCESS ? rc : copy_text("12." STANDIN_DRIVER, version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    struct faults f;
    nvmlReturn_t rc = enter(__func__, -1, &f);
    if (rc == NVML_SUCCESS)
        *count = (unsigned int)gpu_count;
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    struct faults f;
    int gpu = valid_gpu((int)index) ? (int)index : -1;
    nvmlReturn_t rc = enter(__func__, gpu, &f);
    if (rc == NVML_SUCCESS && gpu < 0)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *device = &gpus[gpu];
    return rc;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE_CALL(device);
    *index = (unsigned int)gpu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_CALL(device);
    char text[128], profiles[STANDIN_MIG_SLOTS][NAME_LEN];
    int count = 0;
    if (device->mig < 0) {
        /* As the stand-in nvidia-smi names them. */
        snprintf(text, sizeof text, "GPU-%08d-aaaa-bbbb-cccc-%012d", gpu, gpu);
    } else {
        mig_state(gpu, profiles, &count, NULL);
        if (device->mig >= count)
            return NVML_ERROR_NOT_FOUND;
        snprintf(text, sizeof text, "MIG-%d-%d-%s", gpu, device->mig, profiles[device->mig]);
    }
    return copy_text(text, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_CALL(device);
    return copy_text("NVIDIA H100 80GB HBM3", name, length);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_CALL(device);
    memset(pci, 0, sizeof *pci);
    pci->bus = gpu_bus[gpu];
    pci->pciDeviceId = 0x233010de; /* H100 SXM5 80GB, vendor 0x10de */
    pci->pciSubSystemId = 0x16c110de;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", 0, pci->bus, 0);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", 0, pci->bus, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    DEVICE_CALL(device);
    (void)sensor;
    *temp = (unsigned int)f.temperature[gpu];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts) {
    DEVICE_CALL(device);
    *milliwatts = 72000;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *rates) {
    DEVICE_CALL(device);
    rates->gpu = 0;
    rates->memory = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE_CALL(device);
    memory->total = 81559ULL << 20; /* an H100 80GB HBM3 as nvidia-smi shows it: 81559 MiB */
    memory->used = 1ULL << 20;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                         unsigned long long *count) {
    DEVICE_CALL(device);
    (void)counterType;
    *count = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? f.ecc[gpu] : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred) {
    DEVICE_CALL(device);
    *corrRows = 0;
    *uncRows = (unsigned int)(f.remap_pending[gpu] + f.remap_failure[gpu]);
    *isPending = (unsigned int)f.remap_pending[gpu];
    *failureOccurred = (unsigned int)f.remap_failure[gpu];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *reasons) {
    DEVICE_CALL(device);
    *reasons = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    DEVICE_CALL(device);
    for (int i = 0; i < count; i++) {
        int known = values[i].fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION;
        values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        values[i].nvmlReturn = known ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
        values[i].value.ullVal = 0;
        values[i].value.uiVal = known ? (unsigned int)f.recovery[gpu] : 0;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                  unsigned int *pending) {
    DEVICE_CALL(device);
    char profiles[STANDIN_MIG_SLOTS][NAME_LEN];
    int count, next;
    *current = (unsigned int)mig_state(gpu, profiles, &count, &next);
    *pending = (unsigned int)next;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    DEVICE_CALL(device);
    *count = STANDIN_MIG_SLOTS;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig) {
    DEVICE_CALL(device);
    char profiles[STANDIN_MIG_SLOTS][NAME_LEN];
    int count;
    if (!mig_state(gpu, profiles, &count, NULL))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= (unsigned int)count)
        return NVML_ERROR_NOT_FOUND;
    *mig = &migs[gpu][index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                              unsigned long long *eventTypes) {
    DEVICE_CALL(device);
    *eventTypes = STANDIN_EVENT_TYPES;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    struct faults f;
    nvmlReturn_t rc = enter(__func__, -1, &f);
    if (rc != NVML_SUCCESS)
        return rc;
    *set = calloc(1, sizeof **set);
    if (!*set)
        return NVML_ERROR_UNINITIALIZED;
    (*set)->delivered = f.xids; /* earlier events are not this set's */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set) {
    DEVICE_CALL(device);
    if (!set || eventTypes & ~STANDIN_EVENT_TYPES)
        return NVML_ERROR_NOT_SUPPORTED;
    set->registered[gpu] |= eventTypes;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                 unsigned int timeoutms) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        struct faults f;
        nvmlReturn_t rc = enter(__func__, -1, &f);
        if (rc != NVML_SUCCESS)
            return rc;
        if (f.xids < set->delivered) /* the file was rewritten */
            set->delivered = f.xids;
        while (set->delivered < f.xids) {
            int n = set->delivered++, gpu = f.xid_gpu[n];
            if (valid_gpu(gpu) && set->registered[gpu] & nvmlEventTypeXidCriticalError) {
                *data = (nvmlEventData_t){&gpus[gpu], nvmlEventTypeXidCriticalError,
                                          (unsigned long long)f.xid_code[n], NO_INSTANCE,
                                          NO_INSTANCE};
                return NVML_SUCCESS;
            }
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        long waited = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited >= (long)timeoutms)
            return NVML_ERROR_TIMEOUT;
        pause_ms(10);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    struct faults f;
    nvmlReturn_t rc = enter(__func__, -1, &f);
    if (rc == NVML_SUCCESS)
        free(set);
    return rc;
}
