/*
 * Entry points of the workload guest.
 *
 * _start32: PVH entry (QEMU -kernel, or any PVH loader). 32-bit protected mode, paging off,
 *           %ebx = hvm_start_info. We build identity page tables and switch to long mode.
 * _start64: ELF entry, used by ferry, which enters every vCPU directly in 64-bit mode with its
 *           own identity page tables: %rdi = vCPU index, %rsi = hvm_start_info (BSP only).
 */
#define MAPPED_GIB 64
#define MAX_CPUS 16
#define STACK_SIZE 16384

    .section .note.pvh, "a"
    .align 4
    .long 4                 /* name size: "Xen\0" */
    .long 4                 /* desc size */
    .long 18                /* XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .long _start32

    .section .text.boot, "ax"
    .code32
    .globl _start32
_start32:
    cli
    movl %ebx, %esi                 /* keep start_info across the switch */
    lgdt gdt_ptr

    /* PML4[0] -> PDPT; PDPT[i] -> PD_i; PD entries map 2 MiB pages 1:1. */
    movl $boot_pml4, %edi
    movl $boot_pdpt, %eax
    orl $0x3, %eax
    movl %eax, (%edi)
    xorl %ecx, %ecx
1:  movl %ecx, %eax
    shll $12, %eax
    addl $boot_pd, %eax
    orl $0x3, %eax
    movl %eax, boot_pdpt(,%ecx,8)
    incl %ecx
    cmpl $MAPPED_GIB, %ecx
    jb 1b

    xorl %ecx, %ecx                 /* ecx = 2 MiB page number */
2:  movl %ecx, %eax
    shll $21, %eax
    orl $0x83, %eax                 /* present, writable, 2 MiB */
    movl %ecx, %edx
    shrl $11, %edx                  /* high 32 bits of the physical address */
    movl %eax, boot_pd(,%ecx,8)
    movl %edx, boot_pd+4(,%ecx,8)
    incl %ecx
    cmpl $(MAPPED_GIB * 512), %ecx
    jb 2b

    movl $boot_pml4, %eax
    movl %eax, %cr3
    movl $0x20, %eax                /* CR4.PAE */
    movl %eax, %cr4
    movl $0xc0000080, %ecx          /* EFER: LME | NXE */
    rdmsr
    orl $0x900, %eax
    wrmsr
    movl $0x80050033, %eax          /* PG | AM | WP | NE | ET | MP | PE */
    movl %eax, %cr0
    ljmp $0x10, $long_mode

    .code64
long_mode:
    movl $0x18, %eax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw %ax, %fs
    movw %ax, %gs
    xorl %edi, %edi                 /* vCPU 0; %rsi still holds start_info */
    /* fall through */

    .globl _start64
_start64:
    cmpq $MAX_CPUS, %rdi
    jae 3f
    movq %rdi, %rax
    incq %rax
    imulq $STACK_SIZE, %rax
    leaq stacks(%rax), %rsp
    testq %rdi, %rdi
    jnz 4f
    movq %rsi, %rdi
    call guest_main
    jmp 3f
4:  call secondary_main
3:  hlt
    jmp 3b

    .section .rodata
    .align 16
gdt:
    .quad 0                         /* null */
    .quad 0x00cf9a000000ffff        /* 0x08: 32-bit code */
    .quad 0x00af9a000000ffff        /* 0x10: 64-bit code */
    .quad 0x00cf92000000ffff        /* 0x18: data */
gdt_end:
gdt_ptr:
    .word gdt_end - gdt - 1
    .long gdt

    .section .bss.pagetables, "aw", @nobits
    .align 4096
boot_pml4: .skip 4096
boot_pdpt: .skip 4096
boot_pd:   .skip 4096 * MAPPED_GIB

    .section .bss
    .align 16
    .globl stacks
stacks: .skip STACK_SIZE * MAX_CPUS
