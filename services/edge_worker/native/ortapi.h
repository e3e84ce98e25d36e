// The onnxruntime C API declarations our custom ops use (int4op.c, attn.c), written out here: no onnxruntime header
// is installed with the Python wheel. The OrtApi function table is append-only (an entry never moves); the
// entries used come from versions 1 and 18 (positions counted from onnxruntime's header and a generated binding
// of it, checked at compile time below against those counts and exercised by the tests).
#ifndef MESHSERVE_ORTAPI_H
#define MESHSERVE_ORTAPI_H
#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtCustomOp OrtCustomOp;

enum { ORT_FAIL = 1, ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT32 = 6 };

// The OrtApi entries used, at their positions in the table (index = position); _pN pads the entries between.
typedef struct OrtApi {
    OrtStatus* (*CreateStatus)(int code, const char* msg);  // 0
    void* _p1;                                               // 1 GetErrorCode
    const char* (*GetErrorMessage)(const OrtStatus* status); // 2
    void* _p3[26 - 3];
    OrtStatus* (*CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);   // 26
    OrtStatus* (*CustomOpDomain_Add)(OrtCustomOpDomain* domain, OrtCustomOp* op);      // 27
    OrtStatus* (*AddCustomOpDomain)(OrtSessionOptions* options, OrtCustomOpDomain* d); // 28
    void* _p29[51 - 29];
    OrtStatus* (*GetTensorMutableData)(OrtValue* value, void** out); // 51
    void* _p52[61 - 52];
    OrtStatus* (*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out);           // 61
    OrtStatus* (*GetDimensions)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count); // 62
    void* _p63[65 - 63];
    OrtStatus* (*GetTensorTypeAndShape)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out); // 65
    void* _p66[85 - 66];
    OrtStatus* (*KernelInfoGetAttribute_float)(const OrtKernelInfo* info, const char* name, float* out);   // 85
    OrtStatus* (*KernelInfoGetAttribute_int64)(const OrtKernelInfo* info, const char* name, int64_t* out); // 86
    void* _p87[90 - 87];
    OrtStatus* (*KernelContext_GetInput)(const OrtKernelContext* context, size_t index, const OrtValue** out); // 90
    OrtStatus* (*KernelContext_GetOutput)(OrtKernelContext* context, size_t index, const int64_t* dims,
                                          size_t count, OrtValue** out);                                 // 91
    void* _p92;                                                                                          // 92
    void (*ReleaseStatus)(OrtStatus* status);                                                            // 93
    void* _p94[99 - 94];
    void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* info); // 99
    void* _p100[274 - 100];
    OrtStatus* (*KernelContext_ParallelFor)(const OrtKernelContext* context, void (*fn)(void* data, size_t index),
                                            size_t total, size_t num_batch, void* data);  // 274 (API 18)
} OrtApi;

#define AT(field, index) _Static_assert(offsetof(OrtApi, field) == (index) * sizeof(void*), #field)
AT(GetErrorMessage, 2);
AT(CreateCustomOpDomain, 26);
AT(AddCustomOpDomain, 28);
AT(GetTensorMutableData, 51);
AT(GetDimensionsCount, 61);
AT(GetTensorTypeAndShape, 65);
AT(KernelInfoGetAttribute_float, 85);
AT(KernelInfoGetAttribute_int64, 86);
AT(KernelContext_GetInput, 90);
AT(KernelContext_GetOutput, 91);
AT(ReleaseStatus, 93);
AT(ReleaseTensorTypeAndShapeInfo, 99);
AT(KernelContext_ParallelFor, 274);

typedef struct OrtApiBase {
    const OrtApi* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)(void);
} OrtApiBase;

// OrtCustomOp with every field up to op version OP_VERSION (onnxruntime reads the fields of op.version).
struct OrtCustomOp {
    uint32_t version;
    void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
    const char* (*GetName)(const OrtCustomOp* op);
    const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
    int (*GetInputType)(const OrtCustomOp* op, size_t index);
    size_t (*GetInputTypeCount)(const OrtCustomOp* op);
    int (*GetOutputType)(const OrtCustomOp* op, size_t index);
    size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
    void (*KernelCompute)(void* kernel, OrtKernelContext* context);
    void (*KernelDestroy)(void* kernel);
    int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
    int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
    int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
    int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
    OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
    OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
    void* InferOutputShapeFn;  // none: the output's shape is known once the op runs
    int (*GetStartVersion)(const OrtCustomOp* op);
    int (*GetEndVersion)(const OrtCustomOp* op);
    size_t (*GetMayInplace)(int** input_index, int** output_index);
    void (*ReleaseMayInplace)(int* input_index, int* output_index);
    size_t (*GetAliasMap)(int** input_index, int** output_index);
    void (*ReleaseAliasMap)(int* input_index, int* output_index);
};

#define OP_VERSION 20

// The OrtCustomOp callbacks both ops answer the same way: float outputs on the CPU provider, every input and
// output required, default memory, no variadic arity, op versions 1 onwards, no in-place or alias pairs.
static inline const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static inline int output_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static inline int required(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }  // INPUT_OUTPUT_REQUIRED
static inline int default_memory(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }  // OrtMemTypeDefault
static inline int one(const OrtCustomOp* op) { (void)op; return 1; }
static inline int start_version(const OrtCustomOp* op) { (void)op; return 1; }
static inline int end_version(const OrtCustomOp* op) { (void)op; return 2147483647; }
static inline size_t no_pairs(int** input_index, int** output_index) { *input_index = *output_index = NULL; return 0; }
static inline void release_pairs(int* input_index, int* output_index) { (void)input_index; (void)output_index; }

#endif
